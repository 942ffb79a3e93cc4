"""A request's cache account as the API shows it: ``"kvscope": {"cache": {...}}`` (#35 item 3).

The engine's ``CacheAccount`` (``engine.snapshot``) of the request's own session: tokens reused, recomputed and
dropped (``reused + recomputed + dropped == usage.prompt_tokens``) and the misses as ranges with a reason. The
session belongs to the request's tenant (``engine.core.session_pool``), so no other tenant's text or count can
be in it. One more rule within a tenant: a request that does not go on with a whole conversation reuses it in
whole pages only, so that one more matching token of another conversation changes nothing its client can see
(the pin-code attack); the engine's account would still say where, to the token, the prompt left that
conversation and what the conversation held there. So from the first ``partial_page`` miss on, the misses are
told as one range of that reason: the client learns what ``cached_tokens`` says already, nothing more.
"""

from __future__ import annotations

from typing import Any

from engine.snapshot import CacheAccount, MissReason


def public(account: CacheAccount | None, prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``cache`` object of a response for ``account`` (None: a plain one from the counts, all ``new``)."""
    if account is None:
        rest = prompt_tokens - cached_tokens
        misses = [{"start": cached_tokens, "end": prompt_tokens, "reason": MissReason.NEW.value,
                   "detail": "not in the cache before"}] if rest > 0 else []
        return {"reused": cached_tokens, "recomputed": rest, "dropped": 0, "misses": misses}
    out = account.to_dict()
    misses = out["misses"]
    cut = next((i for i, m in enumerate(misses) if m["reason"] == MissReason.PARTIAL_PAGE.value), None)
    if cut is not None:
        first = misses[cut]
        misses[cut:] = [{**first, "end": misses[-1]["end"]}]
    return out


def recomputed_by_reason(account: CacheAccount | None, prompt_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Recomputed prompt tokens per reason, as ``public`` tells them (``/metrics``' counters)."""
    out: dict[str, int] = {}
    for m in public(account, prompt_tokens, cached_tokens)["misses"]:
        out[m["reason"]] = out.get(m["reason"], 0) + m["end"] - m["start"]
    return out
