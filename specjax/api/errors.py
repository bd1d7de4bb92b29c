"""The API's own error: a call that cannot be carried out as asked, raised before any work."""

from __future__ import annotations


class UsageError(ValueError):
  """An argument the API refuses (an unknown rule or argument, a draft no rule can use, prompts
  of the wrong type): the message names the argument and the fix."""
