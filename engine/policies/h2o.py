"""H2O heavy hitters (Zhang et al., 2023): keep the tokens that received the most attention, plus a recent
window, under a token budget.

Scores are the attention probability each cached token has accumulated over all steps, summed over the
query heads of each KV head (kept per layer and KV head for display); eviction is per layer, ranking by the
sum over a layer's KV heads, so layers keep different tokens. Original positions are kept (no re-rotation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.policies.base import EvictionPolicy, PolicyState, param_field


class H2OPolicy(EvictionPolicy):
    name = "h2o"
    label = "H2O: heavy hitters + recent"
    needs_scores = True

    @dataclass(frozen=True)
    class Params:
        budget: int = param_field(256, min=2, max=1 << 20, help="tokens kept per layer")
        recent: int = param_field(64, min=1, max=1 << 20, help="most recent tokens always kept")

    def validate(self) -> None:
        super().validate()
        if self.params.recent >= self.params.budget:
            raise ValueError(f"policy h2o: recent {self.params.recent} must be smaller than budget {self.params.budget}")

    @property
    def budget(self) -> int:
        return self.params.budget

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        if state.scores is None:
            raise ValueError("h2o needs attention scores")
        out = []
        for layer, pos in enumerate(state.positions):
            n = len(pos)
            drop = max(0, n - target)
            if drop == 0:
                out.append(np.zeros(0, dtype=np.int64))
                continue
            old = n - min(self.params.recent, n)  # candidates: everything before the recent window
            protected = int(np.searchsorted(pos, state.protected))  # never evict the protected prefix
            cand = np.arange(min(protected, old), old)
            s = state.scores[layer][cand]
            order = np.lexsort((cand, s))  # lowest score first, ties: oldest first
            out.append(np.sort(cand[order[:drop]]).astype(np.int64))
        return out
