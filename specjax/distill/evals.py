"""Evaluation hooks of a distillation run: is the draft getting better at the job it is trained for?

* `on_policy_eval`: the TVD between teacher and student on student samples of a fixed held-out
  batch (the on-policy TVD of Theorem 4.1); 1 - TVD is the predicted acceptance rate.
* `speculative_eval`: the measured acceptance rate alpha and block efficiency tau of the speculative
  loop itself (`decoding.speculative.generate`, the exact rule, the teacher as target and the
  student as draft) on a few held-out prompts, with the same key at every evaluation.

A hook is `hook(step, params) -> dict` of scalars (params: the student's, as trained so far);
`combine` runs several as one. Hooks are built from what they use (models, samplers, data already
placed on the mesh), never from the trainer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from specjax import sharding
from specjax.acceptance import registry
from specjax.decoding import speculative
from specjax.distill import data as data_lib
from specjax.distill import losses as losses_lib
from specjax.drafting import HeadDrafter
from specjax.models import Prompt, score
from specjax.models.draft_head import DraftHead, with_target
from specjax.sampling import Warp

Hook = Callable[[int, object], dict]


def on_policy_eval(sampler: data_lib.Sampler, batch, teacher_params, key) -> Hook:
  """eval_tvd / eval_accept on student samples of `batch` (a batch of the train shape, placed as
  the trainer places its batches; `teacher_params` placed likewise). The sampler names the pair."""
  student, teacher = sampler.student, sampler.teacher

  def hook(step: int, params) -> dict:
    sampled = sampler(data_lib.STUDENT, batch, params, teacher_params, key)
    value = float(_tvd(student, teacher, params, teacher_params, sampled))
    return {"eval_tvd": value, "eval_accept": 1.0 - value}
  return hook


@functools.partial(jax.jit, static_argnums=(0, 1))
def _tvd(student, teacher, s_params, t_params, batch):
  s_logits = score(student, s_params, batch.prompt, batch.targets)[0]     # [B, L, V]
  t_logits = score(teacher, t_params, batch.prompt, batch.targets)[0]
  return jnp.mean(losses_lib.tvd(s_logits, t_logits, batch.mask))


@dataclasses.dataclass(frozen=True)
class SpecEval:
  """Settings of the speculative-decoding eval (gamma and sampling from the decode settings)."""
  gamma: int = 4
  max_new_tokens: int = 32
  temperature: float = 1.0
  prompts: int = 8


def heldout_prompts(source, rows: int) -> Prompt:
  """The first `rows` prompts of the source's validation split (data the run never trains on)."""
  prompt = source.batch(0, split="validation").prompt
  if rows > prompt.tokens.shape[0]:
    raise ValueError(f"{rows} eval prompts asked for but a batch holds {prompt.tokens.shape[0]}")
  return Prompt(tokens=prompt.tokens[:rows], lengths=prompt.lengths[:rows])


def speculative_eval(teacher, student, prompts: Prompt, teacher_params, key, settings: SpecEval,
                     *, eos_id: int, mesh) -> Hook:
  """eval_alpha / eval_tau of exact speculative decoding, teacher verifying the student's drafts.
  The prompts are replicated over `mesh` (every host holds the same ones)."""
  rule = registry.get("exact")
  prompts = jax.device_put(prompts, sharding.replicated(mesh))
  warp = Warp(temperature=settings.temperature)

  def hook(step: int, params) -> dict:
    draft = student
    if isinstance(student, DraftHead):        # a head drafts from the teacher's features
      draft, params = HeadDrafter(head=student), with_target(params, teacher_params)
    gen = speculative.generate(teacher, teacher_params, draft, params, prompts, key, rule=rule,
                               gamma=settings.gamma, max_new_tokens=settings.max_new_tokens,
                               warp=warp, eos_id=eos_id)
    return {"eval_alpha": gen.stats.alpha(), "eval_tau": gen.stats.tau()}
  return hook


def combine(*hooks: Hook | None) -> Hook | None:
  """One hook returning the union of the given hooks' records (None when there are none)."""
  live = [h for h in hooks if h is not None]
  if not live:
    return None

  def hook(step: int, params) -> dict:
    out = {}
    for h in live:
      out.update(h(step, params))
    return out
  return hook
