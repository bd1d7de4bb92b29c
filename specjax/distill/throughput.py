"""Training throughput: tokens/s per device, the step time split into its phases, and model FLOPs
utilization (MFU) against the device's bf16 peak.

Model FLOPs of one step (the usual 2 FLOPs per parameter per token forward, 6 with the backward):

    6 * N_student * T                      the student update (forward + backward)
  + 2 * N_teacher * T                      the teacher's scoring forward (distillation only)
  + 2 * N_sampler * T                      on-policy generation, when the step samples its outputs

T is the positions a forward pass covers: rows * (prompt width + target width), padding included
(it is computed). For an encoder-decoder (params with a top-level 'encoder' subtree) the encoder's
params see the prompt positions and the rest (decoder, shared embedding / LM head) the target
positions: 2 * (N_enc * rows * prompt + N_dec * rows * target). Generation is counted at its full
width (prefill plus one position per new token, as the loop computes for every row until all are
done). Attention's own FLOPs (quadratic in length) and the LM head at prompt positions are left out:
the standard approximation, slightly low for long sequences.
"""

from __future__ import annotations

import dataclasses
import math

import jax

# Dense bf16 peak FLOP/s per device (one chip; for GPUs the SXM part, without sparsity), matched
# as a case-insensitive substring of jax's `device_kind`, most specific first.
PEAK_BF16_FLOPS = (
    ("TPU v5 lite", 197e12),     # v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),          # v5p reports itself as "TPU v5"
    ("TPU v4", 275e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


def peak_flops(device_kind: str) -> float | None:
  """The bf16 peak of a device kind, or None (CPU, unknown devices: MFU is then omitted)."""
  kind = device_kind.lower()
  for key, peak in PEAK_BF16_FLOPS:
    if key.lower() in kind:
      return peak
  return None


@dataclasses.dataclass(frozen=True)
class ParamCount:
  total: int
  encoder: int = 0               # params under a top-level 'encoder' subtree (encoder-decoder)

  @classmethod
  def of(cls, params) -> "ParamCount":
    leaves = jax.tree_util.tree_leaves_with_path(params)
    total = sum(math.prod(x.shape) for _, x in leaves)
    encoder = sum(math.prod(x.shape) for path, x in leaves
                  if path and getattr(path[0], "key", None) == "encoder")
    return cls(total, encoder)

  def forward_flops(self, rows: int, prompt_width: int, target_width: int) -> float:
    """2 FLOPs per parameter per position it processes (module docstring)."""
    if self.encoder:
      return 2.0 * rows * (self.encoder * prompt_width + (self.total - self.encoder) * target_width)
    return 2.0 * rows * self.total * (prompt_width + target_width)


@dataclasses.dataclass(frozen=True)
class FlopModel:
  """Model FLOPs of a step from the params' sizes and the batch shape."""
  student: ParamCount
  teacher: ParamCount | None = None

  def step_flops(self, rows: int, prompt_width: int, target_width: int,
                 sampled_by: str | None) -> float:
    """sampled_by: 'student' / 'teacher' when the step generated its outputs, else None."""
    shape = (rows, prompt_width, target_width)
    flops = 3.0 * self.student.forward_flops(*shape)                  # 6 N T
    if self.teacher is not None:
      flops += self.teacher.forward_flops(*shape)
    if sampled_by is not None:
      sampler = self.teacher if sampled_by == "teacher" else self.student
      flops += sampler.forward_flops(*shape)
    return flops


PHASES = ("data", "generate", "update")


@dataclasses.dataclass
class Window:
  """Per-step costs between two logged steps -> the throughput fields of a metrics record."""
  devices: int
  peak: float | None = None      # per-device peak FLOP/s; None: no MFU
  steps: int = 0
  tokens: int = 0
  flops: float = 0.0
  seconds: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

  def add(self, tokens: int, flops: float, seconds: dict) -> None:
    self.steps += 1
    self.tokens += int(tokens)
    self.flops += flops
    for phase in PHASES:
      self.seconds[phase] += seconds.get(phase, 0.0)

  def summary(self) -> dict:
    """tokens/s (global and per device), mean seconds per step and per phase, model TFLOP/s per
    device, and MFU where the device's peak is known; then reset."""
    elapsed = max(sum(self.seconds.values()), 1e-9)
    steps = max(self.steps, 1)
    per_device = self.flops / elapsed / self.devices                    # model FLOP/s
    out = {"tokens_per_s": self.tokens / elapsed,
           "tokens_per_s_per_device": self.tokens / elapsed / self.devices,
           "step_s": elapsed / steps,
           **{f"{phase}_s": self.seconds[phase] / steps for phase in PHASES},
           "tflops_per_device": per_device / 1e12}
    if self.peak:
      out["mfu"] = per_device / self.peak
    self.steps, self.tokens, self.flops = 0, 0, 0.0
    self.seconds = dict.fromkeys(PHASES, 0.0)
    return out
