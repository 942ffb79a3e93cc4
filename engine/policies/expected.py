"""Expected Attention (Devoto et al., 2025; NVIDIA kvpress's ``ExpectedAttentionPress``): keep the tokens the
*coming* queries are expected to attend to, plus attention sinks and a recent window, under a token budget.

Why this method here. On kvpress's leaderboard (RULER 4k, Qwen3-8B and Llama-3.1-8B, compression 0.25-0.875)
the query-agnostic methods rank KVzip first (context-reconstruction scores: 3-4x smaller KV with negligible
loss, but it re-reads the whole context once more, ~2x the prefill), then KVzap (a trained surrogate of KVzip,
weights per model), then Expected Attention, DuoAttention and Compactor; StreamingLLM and H2O rank below them.
KVzip's second pass does not fit a chat whose cache is written as it goes: every eviction of a paged cache
during a reply would re-run the context (on this 2-core CPU a 2k-token prefill of a 135M model takes ~11 s),
and KVzap needs a surrogate trained per model. Expected Attention needs only what the attention already
computes: the statistics of the recent queries. It is cheap at decode time, and it scores every cached key
the way H2O wants to (how much attention will it get?) without H2O's bias towards old tokens, which collect
attention for longer, and without H2O's explicit-softmax attention on every step (the model's own SDPA runs).

The method, per full-attention layer and query head (``engine.core.expected`` computes it, at the forward
after which this policy evicts):

1. the last ``queries`` queries of the layer (those of the sink tokens left out), un-rotated to before RoPE,
   give a mean ``mu`` and covariance ``S`` per head;
2. RoPE averaged over the next 512 positions (kvpress's ``n_future_positions``) is applied to them: the
   expected query of the coming tokens;
3. a key ``k`` then expects attention ``exp(s mu.k + s^2 k^T S k / 2)`` (``s`` the attention's scale; the
   Gaussian moment of ``exp(s q.k)``), normalised over the keys (softmax), averaged over the heads of the
   key's KV group and multiplied by the value's norm ``||v||`` (what dropping the token takes from the
   output);
4. each KV head of each layer drops its own lowest-scored tokens, as kvpress's press does: every head keeps
   as many tokens, so a layer's pages stay one block of slots in which each head packs its own kept tokens
   (``engine.kv.paged.positions.CacheIndex``); the page map counts slots, and the token strip shows a token
   some heads dropped as "kept by some heads". ``per_head`` off: a layer's heads keep one set (scores summed).

Where kvpress's press differs: it compresses once, after the prefill, by a ratio; this policy evicts during
the whole chat (prefill and reply) to a budget, per layer and head, from the recent queries' statistics
(kvpress: the whole prompt's), and also keeps the protected prompt (system + first message) and a recent
window until nothing else is left. Switched on mid-chat from another setting it has seen no queries: its first
eviction takes the oldest and says so; its budget lowered mid-chat, it scores the held keys at once from the queries
it saw. Original positions are kept (no re-rotation), as H2O keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.policies.base import EvictionPolicy, PolicyState, drop_in_order, param_field


class ExpectedAttentionPolicy(EvictionPolicy):
    name = "expected"
    label = "Expected attention: predicted future attention + recent"
    needs_queries = True

    @dataclass(frozen=True)
    class Params:
        budget: int = param_field(256, min=2, max=1 << 20, help="tokens kept per layer", flag="budget")
        recent: int = param_field(64, min=1, max=1 << 20, help="most recent tokens always kept", flag="window")
        sinks: int = param_field(4, min=0, max=1024, help="first tokens always kept (attention sinks)",
                                 flag="sinks")
        queries: int = param_field(128, min=1, max=4096, help="recent queries whose statistics predict the coming ones")
        per_head: bool = param_field(True, help="each KV head keeps its own tokens (kvpress's way); off: a layer's "
                                     "heads keep one set, their scores summed")

    def validate(self) -> None:
        super().validate()
        p = self.params
        if p.recent + p.sinks >= p.budget:
            raise ValueError(f"policy expected: recent {p.recent} + sinks {p.sinks} must be smaller than budget "
                             f"{p.budget}")

    @property
    def budget(self) -> int:
        return self.params.budget

    @property
    def per_head(self) -> bool:  # type: ignore[override]
        return self.params.per_head

    def slack(self, page_size: int) -> int:
        p = self.params
        return max(1, min(page_size, p.budget // 8, p.budget - p.recent - p.sinks - 1))

    def sink_count(self, n_tokens: int) -> int:
        return min(self.params.sinks, n_tokens)

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        """Drop order per row (layer, or layer and KV head): unprotected tokens by expected attention (lowest first,
        ties oldest first), then the protected prompt (same order), then the sinks and the recent window (oldest
        first)."""
        out = []
        for row, pos in enumerate(state.positions):
            n = len(pos)
            scores = state.scores[row] if state.scores is not None else np.zeros(n)
            idx = np.arange(n)
            keep_always = (idx >= n - min(self.params.recent, n)) | (pos < self.params.sinks)
            tier = np.where(keep_always, 2, np.where(pos < state.protected, 1, 0))
            rank = np.where(tier == 2, idx, scores)  # sinks and the recent window go oldest first, if ever
            order = np.lexsort((idx, rank, tier))
            out.append(drop_in_order(order, n, target))
        return out
