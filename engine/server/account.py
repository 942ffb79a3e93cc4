"""A request's cache account as the API shows it: ``"kvscope": {"cache": {...}}``.

The engine's ``CacheAccount`` (``engine.snapshot``) of the request's own session: tokens reused, recomputed and
dropped (``reused + recomputed + dropped == usage.prompt_tokens``) and the misses as ranges with a reason. The
session belongs to the request's tenant (``engine.core.session_pool``), so no other tenant's text or count can
be in it.

One more rule within a tenant. A prompt that does not go on with a whole conversation (``own`` false) reuses
another in whole pages only, so that one more matching token of it changes nothing the client can see (the
pin-code attack). The engine's account of such a prompt would still tell it: where, to the token, the prompt
left that conversation (a ``partial_page`` range then ``diverged`` when a guessed digit was right, ``diverged``
at once when it was wrong), the conversation's own text there (the ``diverged`` detail), and even whether the
pool took that conversation or made a new session (``new``: measured, the right digit alone got ``new``). So
for such a prompt the tail of ``new`` / ``diverged`` / ``partial_page`` misses is told as one range from the
first token computed: ``partial_page`` when whole pages were reused, ``new`` when none were. The client learns
what ``cached_tokens`` says already, nothing more; other reasons (``disk``, ``evicted``, ...) before that tail are
about whole pages or the client's own settings and stay as they are.
"""

from __future__ import annotations

from typing import Any

from engine.snapshot import CacheAccount, MissReason

NEW = "not in the cache before"
TAIL = {MissReason.NEW.value, MissReason.DIVERGED.value, MissReason.PARTIAL_PAGE.value}


def cut_detail(grain: int) -> str:
    return f"reused in whole pages of {grain} tokens only: this prompt does not go on with a whole conversation"


def public(account: CacheAccount | None, prompt_tokens: int, cached_tokens: int, own: bool = True,
           grain: int = 16) -> dict[str, Any]:
    """The ``cache`` object of a response for ``account`` (None: a plain one from the counts); ``own``: the
    prompt goes on with a whole conversation of its session (else the tail rule above, ``grain`` tokens a page)."""
    if account is None:
        rest = prompt_tokens - cached_tokens
        out = {"reused": cached_tokens, "recomputed": rest, "dropped": 0,
               "misses": [{"start": cached_tokens, "end": prompt_tokens, "reason": MissReason.NEW.value,
                           "detail": NEW}] if rest > 0 else []}
    else:
        out = account.to_dict()
    misses = out["misses"]
    if own or not misses:
        return out
    i = len(misses)
    while i > 0 and misses[i - 1]["reason"] in TAIL:
        i -= 1
    if i < len(misses):
        whole = out["reused"] > 0
        misses[i:] = [{"start": misses[i]["start"], "end": misses[-1]["end"],
                       "reason": (MissReason.PARTIAL_PAGE if whole else MissReason.NEW).value,
                       "detail": cut_detail(grain) if whole else NEW}]
    return out


def recomputed_by_reason(cache: dict[str, Any]) -> dict[str, int]:
    """Recomputed prompt tokens per reason of a ``public`` account (``/metrics``' counters)."""
    out: dict[str, int] = {}
    for m in cache["misses"]:
        out[m["reason"]] = out.get(m["reason"], 0) + m["end"] - m["start"]
    return out
