"""Drafters: what proposes tokens to the speculative loop (the contract: drafting/base.py)."""

from specjax.drafting import length
from specjax.drafting.base import ONE_HOT_RULES, Block, Drafter, Proposal, one_hot_refusal
from specjax.drafting.head import HeadDrafter
from specjax.drafting.model import ModelDrafter
from specjax.drafting.ngram import NGram


def as_drafter(draft, rule) -> Drafter:
  """The drafter for `draft` verified by `rule`: a Drafter as given (a ModelDrafter completed by
  the rule: its length policy and vocabulary map), or a draft model wrapped in a ModelDrafter."""
  if not isinstance(draft, Drafter):
    draft = ModelDrafter(draft_model=draft)
  return draft.for_rule(rule) if isinstance(draft, (ModelDrafter, HeadDrafter)) else draft


__all__ = ["Block", "length", "Drafter", "HeadDrafter", "ModelDrafter", "NGram", "ONE_HOT_RULES", "Proposal",
           "as_drafter", "one_hot_refusal"]
