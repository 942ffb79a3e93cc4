"""StreamingLLM (Xiao et al., 2023): attention sinks + a recent window; and the context-overflow modes
("truncate the middle", "rolling window"), which are the same eviction with other sinks.

Positions: keys are cached after RoPE, so when the middle is dropped the kept window is *re-rotated* by the
number of positions it moves (``k·cos Δ + rotate_half(k)·sin Δ``, as HF's old SinkCache did). Every cached
token's RoPE position is then its index in the cache, new tokens continue from there, and no position ever
exceeds ``sinks + window``: generation can go on past the model's ``max_position_embeddings``. The
alternative (keeping original positions) would feed the model positions it never saw in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import OVERFLOW_EVICTS
from engine.policies import turns
from engine.policies.base import EvictionPolicy, PolicyState, param_field


class StreamingPolicy(EvictionPolicy):
    name = "streaming"
    label = "StreamingLLM: sinks + window"
    rope_in_cache = True

    @dataclass(frozen=True)
    class Params:
        sinks: int = param_field(4, min=0, max=1024, help="first tokens always kept (attention sinks)",
                                 flag="sinks")
        window: int = param_field(256, min=1, max=1 << 20, help="most recent tokens kept", flag="window")

    @property
    def budget(self) -> int:
        return self.params.sinks + self.params.window

    def slack(self, page_size: int) -> int:
        return max(1, min(page_size, self.budget // 8, self.params.window - 1))

    def sink_count(self, n_tokens: int) -> int:
        return min(self.params.sinks, n_tokens)

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        out = []
        for pos in state.positions:
            n = len(pos)
            drop = max(0, n - target)
            sinks = min(self.params.sinks, max(0, target - 1))  # at least the newest token stays
            out.append(np.arange(sinks, sinks + drop, dtype=np.int64))  # oldest non-sink tokens
        return out


class OverflowPolicy(StreamingPolicy):
    """What ``CacheConfig.overflow`` does when the context is full and no eviction policy is set:
    ``truncate_middle`` keeps the protected prompt (system + first message) as its sinks, ``rolling`` the
    first token (BOS); both keep the most recent tokens. Not offered as a policy of its own."""

    name = "overflow"
    listed = False

    @classmethod
    def for_mode(cls, mode: str, target: int, protected: int) -> "OverflowPolicy":
        if mode not in OVERFLOW_EVICTS:
            raise ValueError(f"overflow {mode!r} does not evict")
        if mode == "turns":
            return TurnsOverflow(sinks=1, window=max(1, target - 1))
        sinks = protected if mode == "truncate_middle" else 1
        sinks = max(0, min(sinks, target - 1, 1024))
        return cls(sinks=sinks, window=max(1, target - sinks))


class TurnsOverflow(OverflowPolicy):
    """Overflow "turns": drop the oldest whole messages until the cache fits, never the system prompt, a pinned
    message, the latest message or what sits before the first message; only when that is not enough is the latest
    message cut from its oldest token (``engine.policies.turns``). Fewer than ``target`` may stay: whole messages
    go."""

    name = "overflow"
    listed = False

    def default_priority(self) -> int:
        return 0  # reads the messages' priorities: the pinned ones (and the system prompt) are ``PINNED``

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        return [np.flatnonzero(turns.dropped(pos, state.turns, state.priorities, len(pos) - max(1, target)))
                .astype(np.int64) for pos in state.positions]
