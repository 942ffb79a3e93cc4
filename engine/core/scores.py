"""The attention each cached slot has received, per layer and KV head — kept in step with the cache index by the
evictor (``engine.core.eviction``), read by the policies that rank by it (H2O, Expected Attention)."""

from __future__ import annotations

import time

import numpy as np
import torch


class Scores:
    """Attention each cached slot has received (H2O: accumulated; Expected Attention: expected, replaced at each
    scoring), per layer ``[kv_heads, n]`` on the device; kept in step with the cache index by the evictor (every
    append, keep, truncate and reset goes through it)."""

    def __init__(self, num_layers: int, kv_heads: int, device) -> None:
        self.num_layers, self.kv_heads, self.device = num_layers, kv_heads, device
        self.t: list[torch.Tensor] | None = None  # None: not tracking
        self.ms = 0.0  # time ``add`` took (H2O's part of the policy's cost; its explicit softmax is the step's own)

    @property
    def tracking(self) -> bool:
        return self.t is not None

    def start(self, n: int) -> None:
        """Track from now on; the ``n`` tokens already cached start at 0."""
        self.t = [torch.zeros((self.kv_heads, n), dtype=torch.float32, device=self.device)
                  for _ in range(self.num_layers)]

    def stop(self) -> None:
        self.t = None

    def grow(self, q: int) -> None:
        if self.t is not None:
            self.t = [torch.cat([s, s.new_zeros(s.shape[0], q)], dim=1) for s in self.t]  # [Hkv, n + q]

    def keep(self, keep: list[np.ndarray]) -> None:
        """Per layer the slots kept: ``[m]``, or ``[H, m]`` per KV head (``CacheIndex.keep``)."""
        if self.t is None:
            return
        out = []
        for s, k in zip(self.t, keep):
            idx = torch.from_numpy(np.asarray(k, dtype=np.int64)).to(s.device)
            out.append(s[:, idx] if idx.dim() == 1 else s.gather(1, idx))  # [Hkv, m]
        self.t = out

    def truncate(self, n: int) -> None:
        if self.t is not None:
            self.t = [s[:, :n] for s in self.t]

    def add(self, layer: int, probs: torch.Tensor) -> None:
        """probs: [1, Hq, q, L] → add the attention each key received, summed per KV head."""
        t0 = time.perf_counter()
        got = probs[0].sum(dim=1)  # [Hq, L]
        got = got.view(self.kv_heads, -1, got.shape[-1]).sum(dim=1)  # [Hkv, L]
        s = self.t[layer]
        s[:, :got.shape[1]] += got.to(s.dtype)
        self.ms += (time.perf_counter() - t0) * 1000.0

    def put(self, layer: int, scores: torch.Tensor) -> None:
        """scores: [H, L] for the first L slots of ``layer`` (an expected-attention scoring), replacing them. H is
        the attention's KV heads; where the cache keeps other rows (MLA: one latent, heads decompressed from it),
        the heads are summed into them."""
        s = self.t[layer]
        h, n = scores.shape
        if h != s.shape[0]:
            scores = (scores.reshape(s.shape[0], -1, n).sum(1) if h % s.shape[0] == 0
                      else scores.sum(0, keepdim=True).expand(s.shape[0], n) / s.shape[0])  # [rows, L]
        s[:, :n] = scores.to(s.dtype)

    def numpy(self) -> np.ndarray:
        """``[L, n]`` summed over KV heads (CPU)."""
        return np.stack([s.sum(dim=0).cpu().numpy() for s in self.t])

    def rows(self) -> np.ndarray:
        """``[L * Hkv, n]``: one row per layer and KV head (CPU), as a per-head eviction ranks them."""
        return torch.cat(self.t).cpu().numpy()
