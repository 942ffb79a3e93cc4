"""Priority retention (TensorRT-LLM's KV cache retention config): token ranges carry a priority 0..100
(default 35); under the budget the lowest priority goes first, then the least recently used (oldest).
Priority 100 is never evicted: the system prompt and pinned messages get it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.policies.base import EvictionPolicy, PolicyState, param_field

PINNED = 100


class PriorityPolicy(EvictionPolicy):
    name = "priority"
    label = "Priority: pinned ranges"

    @dataclass(frozen=True)
    class Params:
        budget: int = param_field(256, min=2, max=1 << 20, help="tokens kept per layer")
        default_priority: int = param_field(35, min=0, max=99, help="priority of unpinned tokens")
        recent: int = param_field(16, min=0, max=1 << 20, help="most recent tokens kept at priority 99")

    @property
    def budget(self) -> int:
        return self.params.budget

    def token_priorities(self, state: PolicyState, positions: np.ndarray) -> np.ndarray:
        pri = np.full(len(positions), self.params.default_priority, dtype=np.int64)
        if state.priorities is not None:
            known = positions < len(state.priorities)
            pri[known] = state.priorities[positions[known]]
        pri[positions < state.protected] = PINNED
        if self.params.recent:
            pri[-self.params.recent:] = np.maximum(pri[-self.params.recent:], 99)
        return pri

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        out = []
        for pos in state.positions:
            n = len(pos)
            drop = max(0, n - target)
            pri = self.token_priorities(state, pos)
            cand = np.nonzero(pri < PINNED)[0]
            order = np.lexsort((pos[cand], pri[cand]))  # lowest priority, then oldest
            out.append(np.sort(cand[order[:drop]]).astype(np.int64))
        return out
