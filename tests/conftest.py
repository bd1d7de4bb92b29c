"""Settings shared by every test."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def highest_matmul_precision():
  """float32 matmuls run as TF32 on NVIDIA GPUs by default (~1e-3 off), which breaks the parity
  tests (1e-4 and tighter); pin them to full float32 for the session and, through the
  environment, for the subprocesses that CLI and multi-device tests start."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    with jax.default_matmul_precision("highest"):
      yield
