"""H2O heavy hitters (Zhang et al., 2023): keep the tokens that received the most attention, plus a recent
window, under a token budget.

Scores are the attention probability each cached token has accumulated over all steps, summed over the
query heads of each KV head (kept per layer and KV head for display); eviction is per layer, ranking by the
sum over a layer's KV heads, so layers keep different tokens. Original positions are kept (no re-rotation).
Tokens cached before H2O was switched on start with no score (they are ranked oldest first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.policies.base import EvictionPolicy, PolicyState, drop_in_order, param_field


class H2OPolicy(EvictionPolicy):
    name = "h2o"
    label = "H2O: heavy hitters + recent"
    needs_scores = True

    @dataclass(frozen=True)
    class Params:
        budget: int = param_field(256, min=2, max=1 << 20, help="tokens kept per layer", flag="budget")
        recent: int = param_field(64, min=1, max=1 << 20, help="most recent tokens always kept", flag="window")

    def validate(self) -> None:
        super().validate()
        if self.params.recent >= self.params.budget:
            raise ValueError(f"policy h2o: recent {self.params.recent} must be smaller than budget {self.params.budget}")

    @property
    def budget(self) -> int:
        return self.params.budget

    def slack(self, page_size: int) -> int:
        return max(1, min(page_size, self.budget // 8, self.budget - self.params.recent - 1))

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        """Drop order per layer: unprotected older tokens by score (lowest first, ties oldest first), then
        the protected prefix (same order), then the recent window (oldest first)."""
        out = []
        for layer, pos in enumerate(state.positions):
            n = len(pos)
            scores = state.scores[layer] if state.scores is not None else np.zeros(n)
            recent_from = n - min(self.params.recent, n)
            idx = np.arange(n)
            tier = np.where(idx >= recent_from, 2, np.where(pos < state.protected, 1, 0))
            rank = np.where(tier == 2, idx, scores)  # the recent window goes oldest first, if ever
            order = np.lexsort((idx, rank, tier))
            out.append(drop_in_order(order, n, target))
        return out
