"""The only file that knows transformers' Cache API (5.x).

``KVCache`` is a ``transformers.cache_utils.Cache`` whose layers delegate to a ``KVStore``. transformers
applies RoPE, calls ``cache.update(k, v, layer_idx)`` and runs its stock attention (sdpa/eager) on what
``update`` returns, with stock masks. That is exact as long as ``get_seq_length`` and ``get_mask_sizes``
describe what ``update`` returns: ``past`` physical tokens before the forward, ``past + q`` after.

Positions are never derived from the cache: the session always passes ``position_ids`` explicitly.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from engine.kv.storage import KVStore


class _StoreLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "KVCache", layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self._idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states, value_states: [1, kv_heads, q, head_dim], post-RoPE
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self._cache.store
        k, v = store.update(self._idx, key_states, value_states)  # [1, kv_heads, past + q, head_dim]
        sink = self._cache.score_sink
        if sink is not None and isinstance(kwargs.get("kwargs"), dict):
            kwargs["kwargs"]["kvscope_sink"] = sink  # the attention function receives this dict next
        return k, v

    def get_seq_length(self) -> int:
        return self._cache.store.past_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.store.past_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # transformers may call it; the session owns the lifetime instead
        pass


class KVCache(Cache):
    """A transformers ``Cache`` over one of our stores. Build one per forward or keep it per session."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.score_sink = None  # optional fn(layer_idx, probs [1, Hq, q, L]) for attention scores
        super().__init__(layers=[_StoreLayer(self, i) for i in range(store.num_layers)])
