"""StreamingLLM (Xiao et al., 2023): attention sinks + a recent window.

Positions: keys are cached after RoPE, so when the middle is dropped the kept window is *re-rotated* by the
number of positions it moves (``k·cos Δ + rotate_half(k)·sin Δ``, as HF's old SinkCache did). Every cached
token's RoPE position is then its index in the cache, new tokens continue from there, and no position ever
exceeds ``sinks + window``: generation can go on past the model's ``max_position_embeddings``. The
alternative (keeping original positions) would feed the model positions it never saw in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.policies.base import EvictionPolicy, PolicyState, param_field


class StreamingPolicy(EvictionPolicy):
    name = "streaming"
    label = "StreamingLLM: sinks + window"
    rope_in_cache = True

    @dataclass(frozen=True)
    class Params:
        sinks: int = param_field(4, min=0, max=1024, help="first tokens always kept (attention sinks)")
        window: int = param_field(256, min=1, max=1 << 20, help="most recent tokens kept")

    @property
    def budget(self) -> int:
        return self.params.sinks + self.params.window

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        out = []
        for pos in state.positions:
            n = len(pos)
            drop = max(0, n - target)
            sinks = min(self.params.sinks, n)
            out.append(np.arange(sinks, sinks + drop, dtype=np.int64))  # oldest non-sink tokens
        return out
