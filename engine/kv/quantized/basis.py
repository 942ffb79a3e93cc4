"""Attention in a rotated basis: what a rotated read of the cache hands the attention with its K/V.

A rotated page (``engine.kv.quantized.tq_schemes``) holds y = R x; reading it back as x means a ``[D, D]`` matmul
per cached token per layer and step (at 2,048 tokens on the SmolLM2-135M shape: 2 × 30 × 3 × 2,048 vectors of 64,
~1.5 GFLOP a step, more than the model's own weights take). Attention only needs inner products and a weighted
sum, so the cache can hand the pages back *rotated* and the queries and the output turn instead (a few vectors):

    keys    q · k  = (M q) · k'      M = R (k' = R k), or [R; S R] for QJL keys (k' = [ŷ, α‖r‖z], twice as wide)
    values  Σ p v  = Rᵀ Σ p v'       v' = R v: the attention's output turned back once per query

``Basis`` carries M for the keys and R for the values (either None: that half was read in the original basis);
``engine.kv.store.attention.dispatch_attention`` applies it around the attention it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

KEY = "kvscope_basis"  # the attention kwargs entry that carries a ``Basis``


@dataclass(frozen=True)
class Basis:
    keys: Tensor | None  # [Hk, Dk', Dk]: queries become q @ keys[h].T (Dk' = Dk, or 2 Dk with QJL)
    values: Tensor | None  # [Hv, Dv, Dv]: the output becomes out @ values[h]
    fused: object | None = None  # ``tq_attend.FusedPages``: a decode step's pages left as codes (K/V placeholders)

    def queries(self, query: Tensor) -> Tensor:
        """query ``[B, Hq, L, D]`` → ``[B, Hq, L, D']`` (query head h reads kv head h // (Hq / Hk))."""
        if self.keys is None:
            return query
        b, hq, length, d = query.shape
        hk = self.keys.shape[0]
        q = query.reshape(b, hk, hq // hk, length, d)  # [B, Hk, rep, L, D]
        out = torch.matmul(q, self.keys.to(query.dtype).transpose(-1, -2)[:, None])  # [B, Hk, rep, L, D']
        return out.reshape(b, hq, length, -1)

    def outputs(self, out: Tensor) -> Tensor:
        """attention output ``[B, L, Hq, Dv]`` (rotated) → the original basis."""
        if self.values is None:
            return out
        b, length, hq, d = out.shape
        hv = self.values.shape[0]
        o = out.reshape(b, length, hv, hq // hv, d)  # [B, L, Hv, rep, Dv]
        o = torch.einsum("blhrd,hde->blhre", o, self.values.to(out.dtype))  # v = Rᵀ v' as rows: v'ᵀ R
        return o.reshape(b, length, hq, d)
