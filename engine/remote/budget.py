"""A remote reply's ``max_tokens`` fitted to the server's context, as a record the app says in its words.

An OpenAI-compatible server refuses (400) a request whose prompt and ``max_tokens`` together exceed the model's
context (vLLM: "This model's maximum context length is 512 tokens. However, you requested 552 tokens …"; KV
Scope's server says the same), and the chat got an empty reply. ``/v1/models`` reports that context as
``max_model_len`` (vLLM and ours), but not the prompt's length in tokens: the client has no tokenizer. So:

- asked ≥ the context: no prompt leaves room for that many, so ``max_tokens`` is left out and the server gives
  what fits (``context - prompt``: fewer than asked, never more);
- asked < the context but too many beside this prompt: the server refuses, and the request is sent once more
  without ``max_tokens`` (the refusal says the sum is over the context, so what fits is again fewer than asked).

Either way the reply carries a ``TokenBudget`` (``Reply.budget``) saying so.
"""

from __future__ import annotations

from dataclasses import dataclass

# OpenAI's own words for this refusal (its code is "context_length_exceeded"); vLLM and KV Scope use them too
CONTEXT_WORDS = ("maximum context length", "context_length_exceeded")


@dataclass(frozen=True)
class TokenBudget:
    """How many tokens a remote reply was allowed: ``asked`` (the chat's Max new tokens), the model's
    ``context`` (``max_model_len``), ``sent`` (``max_tokens`` sent; None: left to the server, which gives what
    fits), ``refused``: the server refused ``asked`` beside this prompt first. ``prompt_tokens``: the prompt's
    length once the reply told it (0: unknown)."""

    asked: int
    context: int
    sent: int | None
    refused: bool = False
    prompt_tokens: int = 0

    @property
    def lowered(self) -> bool:
        return self.sent is None

    @property
    def room(self) -> int | None:
        """The tokens that fit after the prompt (None while the prompt's length is unknown)."""
        return max(0, self.context - self.prompt_tokens) if self.prompt_tokens else None


def fit(asked: int | None, context: int | None) -> TokenBudget | None:
    """The budget for a reply of ``asked`` tokens on a model of ``context`` (None: nothing to fit — no limit
    asked, or the server reports no context)."""
    if not asked or not context:
        return None
    return TokenBudget(asked, context, None if asked >= context else asked)


def is_context_refusal(message: str) -> bool:
    """The server's refusal says the prompt and ``max_tokens`` exceed its context."""
    low = message.lower()
    return any(w in low for w in CONTEXT_WORDS)
