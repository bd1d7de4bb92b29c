"""The training app's edges: the progress display (plain lines off a terminal, the library's log
lines shown once), the model-FLOPs / MFU arithmetic, and the config checks of train.distill."""

from __future__ import annotations

import io
import logging

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.app import fit
from specjax.distill import throughput


class FakeTerminal(io.StringIO):
  def isatty(self):
    return True


@pytest.fixture
def specjax_logger():
  """The specjax logger as the CLI sets it up: one stream handler, INFO."""
  logger = logging.getLogger("specjax")
  saved = (list(logger.handlers), logger.level, logger.propagate)
  stream = io.StringIO()
  handler = logging.StreamHandler(stream)
  handler.setFormatter(logging.Formatter("specjax: %(message)s"))
  logger.handlers[:] = [handler]
  logger.setLevel(logging.INFO)
  logger.propagate = True       # as a fresh process has it (cli.setup, run earlier, clears it)
  yield logger, stream
  logger.handlers[:], logger.level, logger.propagate = saved


def record(step):
  return {"step": step, "loss": 2.5, "source": "student", "tokens_per_s": 1234.5}


def test_plain_lines_when_not_a_terminal(specjax_logger):
  logger, log_stream = specjax_logger
  out = io.StringIO()
  display = fit.ProgressDisplay(10, stream=out)
  logging.getLogger("specjax.distill.trainer").info("compiling the update step ...")
  display.tick({"step": 1, "total": 10, "loss": 2.5, "step_s": 0.5, "tokens": 100})
  display.show(record(1))
  display.close()
  assert out.getvalue() == "step=1 loss=2.5 source=student tokens_per_s=1234\n"
  assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()
  assert log_stream.getvalue() == "specjax: compiling the update step ...\n"   # once, as set up
  assert logger.propagate is True and logger.handlers[0].stream is log_stream  # restored


def test_terminal_bar_prints_log_lines_above_it(specjax_logger):
  logger, log_stream = specjax_logger
  term = FakeTerminal()
  display = fit.ProgressDisplay(10, stream=term)
  assert logger.propagate is False                     # no second copy through root handlers
  logging.getLogger("specjax.distill.trainer").info("compiled the update step in 1.0s")
  display.tick({"step": 4, "total": 10, "loss": 2.5, "step_s": 0.5, "tokens": 1000})
  display.show(record(4))
  display.close()
  text = term.getvalue()
  assert "specjax: compiled the update step in 1.0s" in text
  assert "step=4 loss=2.5" in text and "loss 2.5 | 2k tok/s | ETA 0:00:03" in text
  assert log_stream.getvalue() == ""                   # routed through the display only
  assert logger.handlers[0].stream is log_stream and logger.propagate is True


def test_eta_clock():
  assert fit._clock(3725.9) == "1:02:05" and fit._clock(100 * 3600) == "100:00:00"


def test_peak_flops_table():
  assert throughput.peak_flops("TPU v4") == 275e12
  assert throughput.peak_flops("TPU v5 lite") == 197e12
  assert throughput.peak_flops("TPU v5p") == throughput.peak_flops("TPU v5") == 459e12
  assert throughput.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
  assert throughput.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert throughput.peak_flops("NVIDIA H200") == 989e12
  assert throughput.peak_flops("cpu") is None


def test_model_flops_and_mfu():
  """6 N T for the update + 2 N T per teacher / generation forward; an encoder-decoder's
  encoder params see the prompt positions only."""
  decoder = throughput.ParamCount.of({"embed": jnp.zeros((10, 4)), "layers": jnp.zeros((2, 5))})
  assert decoder == throughput.ParamCount(total=50, encoder=0)
  t5 = throughput.ParamCount.of({"encoder": {"w": jnp.zeros((3, 10))}, "decoder": jnp.zeros(20),
                                 "shared": jnp.zeros(10)})
  assert t5 == throughput.ParamCount(total=60, encoder=30)
  assert t5.forward_flops(rows=2, prompt_width=8, target_width=4) == 2 * 2 * (30 * 8 + 30 * 4)
  model = throughput.FlopModel(student=decoder, teacher=throughput.ParamCount(500))
  tokens = 4 * (8 + 4)
  assert model.step_flops(4, 8, 4, None) == 6 * 50 * tokens + 2 * 500 * tokens
  assert model.step_flops(4, 8, 4, "student") == 8 * 50 * tokens + 2 * 500 * tokens
  assert model.step_flops(4, 8, 4, "teacher") == 6 * 50 * tokens + 4 * 500 * tokens
  window = throughput.Window(devices=2, peak=1e3)
  window.add(100, 3000.0, {"data": 0.5, "generate": 0.5, "update": 1.0})
  window.add(300, 5000.0, {"data": 0.5, "generate": 0.5, "update": 1.0})
  summary = window.summary()
  assert summary["tokens_per_s"] == 100 and summary["tokens_per_s_per_device"] == 50
  assert (summary["step_s"], summary["update_s"], summary["data_s"]) == (2.0, 1.0, 0.5)
  np.testing.assert_allclose(summary["tflops_per_device"], 8000 / 4 / 2 / 1e12)
  np.testing.assert_allclose(summary["mfu"], 8000 / 4 / (2 * 1e3))
  assert window.steps == 0 and "mfu" not in throughput.Window(devices=1).summary()


def test_negative_steps_are_refused_before_anything_runs(monkeypatch, capsys):
  from specjax.app import cli
  from train import distill
  monkeypatch.setattr(cli, "setup", lambda: None)
  rc = distill.main(["--config", "distill_tiny.py", "--workdir", "/nonexistent/never",
                     "--config.train.steps=-3"])
  assert rc == 2
  assert "--config.train: steps must be >= 1, got -3" in capsys.readouterr().err
