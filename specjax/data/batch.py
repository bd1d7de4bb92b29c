"""The training/evaluation batch shared by data sources and trainers."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from specjax.models import Prompt


@flax.struct.dataclass(kw_only=True)
class Batch:
  prompt: Prompt       # decoder-only: the prefix; T5: the encoder input
  targets: jax.Array   # [B, L] int32 output tokens, right-padded with pad_id
  mask: jax.Array      # [B, L] bool, valid target tokens (EOS included)
  teacher: Any = None  # the teacher's outputs for these tokens, read from a cache (a distill.head
                       # TeacherOutputs) instead of a teacher pass in the step; None: computed
