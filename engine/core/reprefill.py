"""Re-prefill: tokens of a running reply that a cache change left to be read again, tracked as they are read.

A change in the middle of a reply can cut the cache back below what was fed: a policy that does not keep what the
old one evicted (StreamingLLM → H2O, eviction off: the evicted tokens come back from the text), a cache turned
on, a store whose tokens were not moved. The next forwards then read those tokens again before the reply goes
on. ``begin`` (called by ``engine.core.reconfigure.apply``) records it as a ``Reprefill`` on the reply, with what
it should take at the model's measured prefill rate; ``feed`` (called by ``engine.core.step`` after each forward)
moves it on and says how much of the forward's time was its; ``chunk`` keeps its forwards short, so progress is
reported and Stop can act between them. Its time is the re-prefill's, never the reply's TTFT, prefill or decode.

The rate is measured here, per model and per attention path (a policy reading scores runs eager attention,
slower), from the prefill forwards every reply makes (``record``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

from engine.core.records import Reprefill

if TYPE_CHECKING:
    from engine.config import CacheConfig
    from engine.core.sequence import TurnState

MIN_MEASURED = 16  # tokens a forward must feed to count as a prefill rate (a decode step's overhead is not one)
SMOOTHING = 0.5  # weight of the newest forward in the running rate
# Without a measurement yet: ~2 FLOPs per parameter per token at ~200 GFLOP/s on a 2-core CPU, ~10 TFLOP/s on a GPU
FALLBACK_FLOPS = {"cpu": 2e11, "other": 1e13}
CHUNK_SHARE = 8  # a re-prefill feeds 1/8 of a prompt prefill's chunk per forward (~0.6 s on a 2-core CPU, not ~5 s)
MIN_CHUNK = 64

_rates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # ModelRunner -> {scores: tokens per second}


def record(lm, tokens: int, ms: float, scores: bool) -> None:
    """A forward of ``lm`` fed ``tokens`` in ``ms`` (``scores``: on the score-reading path): the running rate."""
    if tokens < MIN_MEASURED or ms <= 0:
        return
    rates = _rates.setdefault(lm.runner, {})
    rate = tokens / (ms / 1000.0)
    old = rates.get(scores)
    rates[scores] = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old


def rate(lm, scores: bool) -> float:
    """Tokens per second a prefill of ``lm`` reads on that path (measured; the plain path's, or 0: none yet)."""
    rates = _rates.get(lm.runner, {})
    return rates.get(scores) or rates.get(False) or 0.0


def estimate_ms(lm, tokens: int, scores: bool) -> float:
    """What reading ``tokens`` again should take: at the measured rate, else from the model's size."""
    measured = rate(lm, scores)
    if measured > 0:
        return tokens / measured * 1000.0
    from engine.quant.modules import parameter_count
    params = parameter_count(lm.model)
    flops = FALLBACK_FLOPS["cpu" if lm.device.type == "cpu" else "other"]
    return 2.0 * params * tokens / flops * 1000.0


def chunk(prefill_chunk: int) -> int:
    """Tokens per forward while a re-prefill runs: a fixed share of the model's prefill chunk (never timing-based,
    so the tokens a setting gives do not depend on the machine's speed)."""
    return min(prefill_chunk, max(MIN_CHUNK, prefill_chunk // CHUNK_SHARE))


def running(reply: "TurnState") -> Reprefill | None:
    """The reply's re-prefill in progress (None: none)."""
    last = reply.reprefills[-1] if reply.reprefills else None
    return last if last is not None and last.done < last.tokens else None


def begin(reply: "TurnState", start: int, until: int, estimate: float, old: "CacheConfig",
          new: "CacheConfig") -> Reprefill:
    """Positions ``[start, until)`` of the reply's sequence are to be read again after ``old`` → ``new``. One still
    running ends where it got to (its tokens past ``start`` are in the new one)."""
    last = running(reply)
    if last is not None:
        until = max(until, last.start + last.tokens)
        reply.reprefills.pop()
        if last.done:  # what it read stays said: "re-prefilled 120 tokens"
            reply.reprefills.append(dataclasses.replace(last, tokens=last.done))
    r = Reprefill(tokens=until - start, start=start, estimate_ms=estimate, old=old, new=new)
    reply.reprefills.append(r)
    return r


def feed(reply: "TurnState", at: int, fed: int, ms: float) -> tuple[Reprefill | None, float]:
    """A forward fed positions ``[at, at + fed)`` in ``ms``: the re-prefill it moved on (None: none ran) and the
    share of ``ms`` that was its (by tokens)."""
    r = running(reply)
    if r is None or fed <= 0:
        return None, 0.0
    until = r.start + r.tokens
    mine = max(0, min(at + fed, until) - max(at, r.start))
    share = ms * mine / fed
    done = min(r.tokens, max(r.done, at + fed - r.start))  # positions passed (a token dropped to fit counts)
    r = dataclasses.replace(r, done=done, ms=r.ms + share)
    reply.reprefills[-1] = r
    return r, share
