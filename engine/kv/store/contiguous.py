"""``ContiguousKV``: a session's KV tensors in one growing buffer per layer (the store protocol and the shared
counters are ``engine.kv.store.storage.KVStore``'s)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from engine.errors import OutOfMemoryError, is_oom
from engine.kv.quantized.roles import KVShape, page_zeros
from engine.kv.store.storage import HostKV, KVStore, host_copy, take_slots


class ContiguousKV(KVStore):
    """One buffer per layer, grown by doubling (one copy per growth, amortised O(1) per token)."""

    def __init__(self, shape: KVShape, initial_tokens: int = 256) -> None:
        super().__init__(shape)
        self._cap = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._grow(max(16, initial_tokens))
        self._len = 0

    @property
    def num_tokens(self) -> int:
        return self._len

    def _grow(self, cap: int) -> None:
        """All layers' new buffers first, then the copy: a failed allocation changes nothing."""
        (hk, dk), (hv, dv) = self.shape.of("k"), self.shape.of("v")
        try:
            new_k = [page_zeros((hk, cap, dk), self.dtype, self.device) for _ in range(self.num_layers)]  # [Hk, cap, Dk]
            new_v = [page_zeros((hv, cap, dv), self.dtype, self.device) for _ in range(self.num_layers)]  # [Hv, cap, Dv]
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            raise OutOfMemoryError(f"out of memory growing the contiguous KV cache to {cap} tokens: use the paged "
                                   "cache with KV int8/int4, or an eviction policy") from None
        n = getattr(self, "_len", 0)
        for old, new in zip(self.k + self.v, new_k + new_v):
            new[:, :n].copy_(old[:, :n])  # [H, n, D]
        self.k, self.v, self._cap = new_k, new_v, cap

    def can_reserve(self, q: int) -> bool:
        return True  # grows on demand; an allocation failure is reported by reserve

    def reserve(self, q: int, owner: int = -1) -> None:
        need = self._len + q
        if need > self._cap:
            cap = self._cap
            while cap < need:
                cap *= 2
            self._grow(cap)
        self._n_before, self._n_new = self._len, q

    def update(self, layer, k, v):
        s, e = self._n_before, self._n_before + self._n_new
        self.k[layer][:, s:e].copy_(k[0])  # k: [1, H, q, D] → buffer slots [s, e)
        self.v[layer][:, s:e].copy_(v[0])
        if s == 0:
            return k, v  # nothing cached before: attention reads the (contiguous) new K/V, as HF does
        return self.k[layer][None, :, :e], self.v[layer][None, :, :e]  # [1, H, e, D] views

    def commit(self) -> None:
        self._len = self._n_before = self._n_before + self._n_new
        self._n_new = 0

    def rollback(self) -> None:
        self._n_before, self._n_new = self._len, 0

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._len:
            raise ValueError(f"truncate: {n} is outside 0..{self._len}")
        self._len = self._n_before = n

    def bytes_per_layer(self) -> list[int]:
        return [self._cap * self.token_bytes] * self.num_layers

    def capacity_tokens(self) -> int:
        return self._cap

    def read_layer(self, layer):
        return self.k[layer][:, :self._len], self.v[layer][:, :self._len]  # [H, n, D] views

    def compact(self, keep, rotate=None, start=0) -> list[int]:
        n_keep = np.shape(keep[0])[-1]
        try:
            for layer in range(self.num_layers):
                idx = np.asarray(keep[layer], dtype=np.int64)[..., start:]  # [m] or [H, m] (per head)
                k = take_slots(self.k[layer][:, :self._len], idx)  # [H, n_keep - start, D] copies
                v = take_slots(self.v[layer][:, :self._len], idx)
                if rotate is not None and getattr(rotate, "role", "k") == "v":  # MLA: its rotary key is the "value"
                    v = rotate(layer, v, idx)
                elif rotate is not None:
                    k = rotate(layer, k, idx)
                self.k[layer][:, start:n_keep].copy_(k)
                self.v[layer][:, start:n_keep].copy_(v)
        except BaseException:
            self.truncate(0)  # some layers rewritten: drop the cache rather than keep it inconsistent
            raise
        self._len = self._n_before = n_keep
        return []

    def to_host(self, pin: bool = False) -> HostKV:
        layers, nbytes = [], 0
        for layer in range(self.num_layers):
            hk, hv = (host_copy(t, pin) for t in self.read_layer(layer))
            layers.append((hk, hv))
            nbytes += 2 * hk.numel() * hk.element_size()
        return HostKV(self._len, layers, nbytes)

    def can_restore(self, host: HostKV, adopt: Sequence[int] = ()) -> bool:
        return True

    def from_host(self, host: HostKV, adopt: Sequence[int] = ()) -> None:
        if adopt:
            raise ValueError("a contiguous cache has no pages to take back")
        if host.n > self._cap:
            self._grow(host.n)
        for layer, (hk, hv) in enumerate(host.layers):
            self.k[layer][:, :host.n].copy_(hk)
            self.v[layer][:, :host.n].copy_(hv)
        self._len = self._n_before = host.n
