"""The paper datasets through TensorFlow Datasets, for users who have prepared them in a data_dir.

tensorflow-datasets is an optional extra (`pip install 'specjax[data]'`), imported only when such a
task is opened. Nothing is downloaded here: a dataset that is not prepared raises `MissingDataError`
naming the command that prepares it. Examples are read with random access (`as_data_source`,
ArrayRecord files) when the dataset was built with `--file_format=array_record`, else the split is
read once into memory (cap it with `max_examples` for LM1B's 30M sentences).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

INSTALL_HINT = "pip install 'specjax[data]'   (or: pip install tensorflow-datasets)"


class MissingDataError(RuntimeError):
  """A dataset (or the package that reads it) is not available on this machine."""


@dataclasses.dataclass(frozen=True)
class TfdsTask:
  """A text task read from TFDS: `examples(split)` gives (input, target) string pairs.

  For LM tasks (`target_key=None`) the target is "" and the source cuts the text into prompt and
  continuation. `splits` maps specjax split names to TFDS split names (LM1B and GSM8K have no
  validation split, so their "validation" is TFDS "test").
  """
  name: str
  tfds_name: str
  input_key: str
  target_key: str | None
  kind: str                                   # "lm" or "seq2seq"
  metric: str | None
  splits: tuple[tuple[str, str], ...] = (("train", "train"), ("validation", "validation"),
                                         ("test", "test"))
  data_dir: str | None = None
  max_examples: int | None = None

  def examples(self, split: str) -> Sequence[tuple[str, str]]:
    names = dict(self.splits)
    if split not in names:
      raise ValueError(f"unknown split {split!r} for {self.name}: use one of {sorted(names)}")
    builder = _prepared_builder(self)
    tfds_split = names[split] + (f"[:{self.max_examples}]" if self.max_examples else "")
    try:
      records = builder.as_data_source(split=tfds_split)
    except Exception:                          # tfrecord files: no random access, read into memory
      tfds = import_tfds(self)
      records = list(tfds.as_numpy(builder.as_dataset(split=tfds_split)))
    return _Pairs(records, self.input_key, self.target_key)

  def prepare_command(self) -> str:
    data_dir = self.data_dir or os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")
    return f"tfds build {self.tfds_name} --data_dir={data_dir} --file_format=array_record"


def import_tfds(task: TfdsTask):
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise MissingDataError(
        f"task {task.name!r} reads the TFDS dataset {task.tfds_name!r}, but tensorflow-datasets "
        f"is not installed. Install it with: {INSTALL_HINT}; then prepare the data once with: "
        f"{task.prepare_command()} . The offline tasks 'stdlib_lm' and 'stdlib_sum' need neither."
    ) from e
  return tfds


def _prepared_builder(task: TfdsTask):
  tfds = import_tfds(task)
  hint = (f"Prepare it once (with network access) with: {task.prepare_command()} , and pass the "
          "same directory as the task's data_dir (or set TFDS_DATA_DIR). "
          "The offline tasks 'stdlib_lm' and 'stdlib_sum' need no download.")
  try:
    builder = tfds.builder(task.tfds_name, data_dir=task.data_dir)
  except Exception as e:
    raise MissingDataError(f"TFDS dataset {task.tfds_name!r} is not available ({e}). {hint}") from e
  if not os.path.isfile(os.path.join(os.fspath(builder.data_dir), "dataset_info.json")):
    raise MissingDataError(f"TFDS dataset {task.tfds_name!r} is not prepared under "
                           f"{builder.data_dir}. {hint}")
  return builder


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class _Pairs(Sequence):
  """Random-access view of TFDS records as (input, target) strings."""

  def __init__(self, records, input_key: str, target_key: str | None):
    self._records, self._input, self._target = records, input_key, target_key

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    record = self._records[i]
    target = _text(record[self._target]) if self._target else ""
    return _text(record[self._input]), target


VALID_IS_TEST = (("train", "train"), ("validation", "test"), ("test", "test"))

PAPER_TASKS = (
    TfdsTask("lm1b", "lm1b", "text", None, "lm", None, splits=VALID_IS_TEST),
    TfdsTask("xsum", "xsum", "document", "summary", "seq2seq", "rouge"),
    TfdsTask("cnn_dailymail", "cnn_dailymail", "article", "highlights", "seq2seq", "rouge"),
    TfdsTask("wmt14_en_de", "wmt14_translate/de-en", "en", "de", "seq2seq", "bleu"),
    # GSM8K is not in the TFDS catalog; TFDS reads it from the Hugging Face hub namespace.
    TfdsTask("gsm8k", "huggingface:gsm8k/main", "question", "answer", "seq2seq", "gsm8k",
             splits=VALID_IS_TEST),
)
