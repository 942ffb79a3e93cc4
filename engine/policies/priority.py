"""Priority retention (TensorRT-LLM's KV cache retention config): token ranges carry a priority 0..100
(default 35); under the budget the lowest priority goes first, then the least recently used (oldest).
Priority 100 (the system prompt, the first message and pinned messages) goes only when the budget cannot
hold it all (and the user is told).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.policies.base import DEFAULT_PRIORITY, PINNED, EvictionPolicy, PolicyState, drop_in_order, param_field


class PriorityPolicy(EvictionPolicy):
    name = "priority"
    label = "Priority: pinned ranges"

    @dataclass(frozen=True)
    class Params:
        budget: int = param_field(256, min=2, max=1 << 20, help="tokens kept per layer", flag="budget")
        default_priority: int = param_field(DEFAULT_PRIORITY, min=0, max=PINNED - 1,
                                            help="priority of unpinned tokens")
        recent: int = param_field(16, min=0, max=1 << 20, help="most recent tokens kept at priority 99",
                                  flag="window")

    @property
    def budget(self) -> int:
        return self.params.budget

    def default_priority(self) -> int:
        return self.params.default_priority

    def token_priorities(self, state: PolicyState, positions: np.ndarray) -> np.ndarray:
        pri = np.full(len(positions), self.params.default_priority, dtype=np.int64)
        if state.priorities is not None:
            known = positions < len(state.priorities)
            pri[known] = state.priorities[positions[known]]
        pri[positions < state.protected] = PINNED
        if self.params.recent:
            pri[-self.params.recent:] = np.maximum(pri[-self.params.recent:], PINNED - 1)
        return pri

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        out = []
        for pos in state.positions:
            pri = self.token_priorities(state, pos)
            order = np.lexsort((pos, pri))  # lowest priority, then oldest; pinned last
            out.append(drop_in_order(order, len(pos), target))
        return out
