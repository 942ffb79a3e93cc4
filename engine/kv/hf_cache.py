"""The only file that knows transformers' Cache API (5.x).

``KVCache`` is a ``transformers.cache_utils.Cache`` whose attention layers delegate to a ``KVStore``.
transformers applies RoPE, calls ``cache.update(k, v, layer_idx)`` and runs its stock attention (sdpa/eager) on
what ``update`` returns, with stock masks. That is exact as long as ``get_seq_length`` and ``get_mask_sizes``
describe what ``update`` returns: for a full-attention layer ``past`` physical tokens before the forward and
``past + q`` after; for a sliding-window layer (``engine.kv.store.window``) the logical position of the first key
it returns, so the model's own sliding mask hides what left the window. Recurrent / convolution layers of
hybrid models are transformers' own layer objects, held by the store (``engine.kv.store.states``).

Positions are never derived from the cache: the session always passes ``position_ids`` explicitly.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from engine.kv.quantized.basis import KEY as BASIS_KEY
from engine.kv.store.attention import PADDED_KEY, RAGGED_KEY, RaggedUnsupported  # noqa: F401 - RaggedUnsupported re-exported
from engine.kv.store.paged_decode import STEP_KEY
from engine.kv.store.storage import KVStore


class _OurLayer(CacheLayerMixin):
    """What our layer objects share: the session owns their lifetime, transformers only reads and updates."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache, layer_idx: int) -> None:
        super().__init__()
        self._cache, self._idx = cache, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # transformers may call it; the session owns the lifetime instead
        pass


class _StoreLayer(_OurLayer):
    def __init__(self, cache: "KVCache", layer_idx: int, sliding: bool = False, score_idx: int | None = None) -> None:
        super().__init__(cache, layer_idx)
        self.is_sliding = sliding
        self._score_idx = score_idx  # row of the attention scores (full layers), None: not tracked

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states [1, k_heads, q, k_dim], value_states [1, v_heads, q, v_dim]: post-RoPE
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        attn = kwargs.get("kwargs")
        if self._cache.rotated_ok and isinstance(attn, dict):  # the attention turns queries and output (tq pages)
            k, v, basis = self._cache.store.update_in_basis(self._idx, key_states, value_states)
            if basis is not None:
                attn[BASIS_KEY] = basis
        else:
            k, v = self._cache.store.update(self._idx, key_states, value_states)  # [1, heads, past + q, dim]
        sink, observer = self._cache.score_sink, self._cache.query_sink
        if self._score_idx is not None and isinstance(kwargs.get("kwargs"), dict):
            row = self._score_idx
            if sink is not None:
                kwargs["kwargs"]["kvscope_sink"] = lambda _layer, probs: sink(row, probs)  # the attention gets it next
            if observer is not None:
                kwargs["kwargs"]["kvscope_observer"] = lambda q, k, v, scale: observer(row, q, k, v, scale)
        return k, v

    def get_seq_length(self) -> int:
        store = self._cache.store
        return store.layer_seq_length(self._idx) if self._cache.grouped else store.past_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        store = self._cache.store
        if self._cache.grouped:
            return store.layer_mask_sizes(self._idx, query_length)
        return store.past_len + query_length, 0


def _with_state(hf_layer, ours: _StoreLayer):
    """A layer with attention and a recurrent / conv state side by side (Falcon-H1): transformers' own object
    keeps the state (its ``update_conv_state`` and friends), its attention goes to our store."""
    for name in ("update", "get_seq_length", "get_mask_sizes", "get_max_length"):
        setattr(hf_layer, name, getattr(ours, name))
    hf_layer.is_sliding = ours.is_sliding
    return hf_layer


class KVCache(Cache):
    """A transformers ``Cache`` over one of our stores (plain, or ``GroupedKV`` for models whose layers differ)."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.score_sink = None  # optional fn(score row, probs [1, Hq, q, L]) for attention scores
        # the model's attention is ``engine.kv.store.attention.dispatch_attention`` and nothing reads its insides (the
        # runner says, per forward): rotated pages (tq kinds) are then read rotated, the queries and output turned
        self.rotated_ok = False
        self.query_sink = None  # optional fn(score row, query, key, value, scale): the attention's inputs (post-RoPE)
        routes = getattr(store, "routes", None)
        self.grouped = routes is not None
        layers = []
        for i in range(store.num_layers):
            route = routes[i] if routes is not None else ("full", i)
            if route[0] == "state":
                layers.append(store.states.layers[i])  # transformers' own recurrent / conv layer object
            elif route[0] == "none":
                layers.append(DummyLayer())  # an MLP-only layer: caches nothing
            else:
                ours = _StoreLayer(self, i, sliding=route[0] == "window",
                                   score_idx=route[1] if route[0] == "full" else None)
                if self.grouped and store.layout.has_state(i):
                    ours = _with_state(store.states.layers[i], ours)
                layers.append(ours)
        super().__init__(layers=layers)


class _BatchLayer(_OurLayer):
    """One layer of a batched forward over several sequences, their tokens laid end to end (as vLLM's varlen
    batches): segment b of the new K/V goes to sequence b's store; the attention reads each sequence's own K/V
    (``kwargs[RAGGED_KEY]``), so lengths differ and nothing is padded."""

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states [1, k_heads, N, k_dim], value_states [1, v_heads, N, v_dim]: post-RoPE, N = sum of segments
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise RaggedUnsupported("this model's attention does not hand its arguments to the cache")
        lens = self._cache.lens
        ks, vs = key_states.split(lens, dim=2), value_states.split(lens, dim=2)  # B x [1, H, q_b, D]
        # (K [1, H, n_b, D], V, Basis or None): tq pages stay rotated, a decode token's as codes (tq_attend)
        read = (lambda st, k, v: st.update_in_basis(self._idx, k, v)) if self._cache.rotated_ok else \
            (lambda st, k, v: (*st.update(self._idx, k, v), None))
        parts = [read(store, k, v) for store, k, v in zip(self._cache.stores, ks, vs)]
        attn_kwargs[RAGGED_KEY] = (parts, lens)
        return key_states, value_states  # not read: the ragged attention takes the parts

    def get_seq_length(self) -> int:
        return 0  # positions are passed explicitly; no mask is built (see BatchCache)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(s.past_len for s in self._cache.stores) + query_length, 0


class BatchCache(Cache, PagedAttentionCache):
    """A transformers ``Cache`` over several sequences' plain stores, for one forward of their tokens laid end to
    end (``lens``: tokens of each; a decode token is 1, a prefill chunk more). Like ``StepCache`` it is a
    ``PagedAttentionCache`` to transformers' mask builder, which then builds none: the ragged attention masks
    each segment itself."""

    def __init__(self, stores: list[KVStore], lens: list[int], rotated_ok: bool = True) -> None:
        self.stores, self.lens = stores, lens
        self.rotated_ok = rotated_ok  # tq pages may be read rotated (the ragged attention turns queries and output)
        Cache.__init__(self, layers=[_BatchLayer(self, i) for i in range(stores[0].num_layers)])


class _StepLayer(_OurLayer):
    """One layer of a compiled decode step (``engine.model.fast_step``): the past K/V are gathered from the session's
    page slots, the new token's K/V appended. Nothing is written inside the step: the new K/V are kept here
    and written to the pages after it, so the compiled graph has no side effects and a failed step changes
    nothing."""

    is_compileable = True

    def __init__(self, cache: "StepCache", layer_idx: int, k, v) -> None:
        super().__init__(cache, layer_idx)
        self.k, self.v = k, v  # this layer's page tensors: [Hk, S, Dk], [Hv, S, Dv] (S = pages * P)
        self.is_initialized = True
        self.new = None

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states [1, Hk, 1, Dk], value_states [1, Hv, 1, Dv]: post-RoPE, the one new token
        self.new = (key_states, value_states)
        slots = self._cache.slots
        k, v = (t.index_select(1, slots)[None] for t in (self.k, self.v))  # [1, H, n, D]
        k, v = torch.cat([k, key_states], 2), torch.cat([v, value_states], 2)  # [1, H, n + 1, D]
        attn = kwargs.get("kwargs")
        if isinstance(attn, dict):  # the attention may read the pages in place instead: the compiler drops k, v then
            attn[STEP_KEY] = (self.k, self.v, slots, None, key_states, value_states, k, v)
        return k, v

    def get_seq_length(self) -> int:
        return 0  # positions are passed explicitly; no mask is built (see StepCache)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.slots.shape[0] + query_length, 0


class StepCache(Cache, PagedAttentionCache):
    """A transformers ``Cache`` for one compiled decode step over a plain paged store's page tensors.

    It is also a ``PagedAttentionCache`` (transformers' continuous-batching cache, none of whose code runs
    here) for one reason: transformers' mask builder then builds no mask. One new token attends to every key
    the step returns, so none is needed; and under ``torch.compile`` on torch < 2.14 the builder would make
    one, after which HF's sdpa repeats K/V for GQA instead of passing ``enable_gqa`` (a copy of the whole
    context per layer: SmolLM2's 3 K/V heads to 9 made the compiled step slower than eager at 2,048 tokens)."""

    def __init__(self, ks: list, vs: list, slots) -> None:
        self.slots = slots  # [n] long: the slots of the tokens already cached, in order
        Cache.__init__(self, layers=[_StepLayer(self, i, k, v) for i, (k, v) in enumerate(zip(ks, vs))])

    def new_kv(self) -> tuple[list, list]:
        """The new token's K and V of every layer, as the model computed them: [1, H, 1, D] each."""
        return [layer.new[0] for layer in self.layers], [layer.new[1] for layer in self.layers]


class _BatchStepLayer(_StepLayer):
    """One layer of the compiled batched decode step (``engine.model.fast_batch``): each sequence's past K/V gathered
    from its page slots, padded to the longest; the attention masks the padding (``PADDED_KEY``). Nothing is
    written inside the step (``_StepLayer``)."""

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states [B, Hk, 1, Dk], value_states [B, Hv, 1, Dv]: post-RoPE, each sequence's new token
        attn = kwargs.get("kwargs")
        if not isinstance(attn, dict):
            raise RaggedUnsupported("this model's attention does not hand its arguments to the cache")
        self.new = (key_states, value_states)
        slots = self._cache.slots  # [B, n]
        b, n = slots.shape
        k, v = (t.index_select(1, slots.reshape(-1)).view(t.shape[0], b, n, t.shape[2]).transpose(0, 1)
                for t in (self.k, self.v))  # [B, H, n, D]
        attn[PADDED_KEY] = self._cache.keep
        k, v = torch.cat([k, key_states], 2), torch.cat([v, value_states], 2)  # [B, H, n + 1, D]
        # the attention may read the pages in place instead (the compiler then drops k, v and the mask)
        attn[STEP_KEY] = (self.k, self.v, slots, self._cache.lens, key_states, value_states, k, v)
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.slots.shape[1] + query_length, 0


class BatchStepCache(Cache, PagedAttentionCache):
    """A transformers ``Cache`` for the compiled batched decode step: B sequences' one new token each over one
    arena's page tensors. ``slots`` [B, n] long: each sequence's cached tokens' slots in order, padded (any slot)
    to the longest, ``lens`` [B] long: how many are its own. A ``PagedAttentionCache`` to transformers' mask builder
    (no mask built, see ``StepCache``): the keep mask goes to the attention instead."""

    def __init__(self, ks: list, vs: list, slots, lens) -> None:
        self.slots, self.lens = slots, lens
        n = slots.shape[1]
        at = torch.arange(n + 1, device=slots.device)[None]  # [1, n + 1]
        self.keep = ((at < lens[:, None]) | (at == n))[:, None, None]  # [B, 1, 1, n + 1]: own keys and the new one
        Cache.__init__(self, layers=[_BatchStepLayer(self, i, k, v) for i, (k, v) in enumerate(zip(ks, vs))])

    def new_kv(self) -> tuple[list, list]:
        """Each layer's new K and V of every sequence: [B, H, 1, D] each."""
        return [layer.new[0] for layer in self.layers], [layer.new[1] for layer in self.layers]
