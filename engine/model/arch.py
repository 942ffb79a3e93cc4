"""What a model hands to its cache, per layer: found by asking it, not by reading config names.

``probe(model)`` runs the model once on three tokens with transformers' own ``DynamicCache`` (built from the
model's config, so every layer gets the cache layer class transformers gives its type) and reads back, per
layer, what it cached:

- ``full``: a ``DynamicLayer`` (keys and values grow with the sequence);
- ``sliding``: a ``DynamicSlidingWindowLayer`` (sliding or chunked attention: only the last ``window`` tokens
  matter);
- ``state``: a linear-attention / convolution / state-space layer (a fixed-size state, whatever the length);
- ``full+state`` / ``sliding+state``: both in one layer (attention and a state side by side: Falcon-H1);
- ``none``: a layer that caches nothing (KV shared with another layer, MLP-only layers).

K and V widths come from the tensors the model produced: Falcon-7B names its KV-head count
``num_kv_heads``, DeepSeek's MLA caches keys and values of different widths (a rotary part is concatenated
to the keys), and a config can say anything; the tensors cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL, SLIDING, STATE, NONE = "full", "sliding", "state", "none"
WITH_STATE = "+state"  # an attention layer that also holds a recurrent / conv state (Falcon-H1, Zamba2)


@dataclass(frozen=True)
class LayerFacts:
    kind: str  # FULL | SLIDING | STATE | NONE, or the cache layer class name when unknown
    window: int = 0  # sliding layers: tokens a query may see (itself included)
    k_heads: int = 0
    k_dim: int = 0
    v_heads: int = 0
    v_dim: int = 0
    state_bytes: int = 0  # state layers: bytes of their fixed-size state (batch 1)

    @property
    def attention(self) -> bool:
        return base_kind(self.kind) in (FULL, SLIDING)


def base_kind(kind: str) -> str:
    """"full" for "full+state", and so on."""
    return kind[:-len(WITH_STATE)] if kind.endswith(WITH_STATE) else kind


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(v) for v in x)
    return 0


_ATTENTION = ("DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionAndFullAttentionLayer",
              "LinearAttentionAndSlidingWindowAttentionLayer")


def _classify(layer) -> LayerFacts:
    name = type(layer).__name__
    state = _tensor_bytes(getattr(layer, "conv_states", None)) + _tensor_bytes(getattr(layer, "recurrent_states", None))
    if name in _ATTENTION:
        k, v = layer.keys, layer.values  # [1, heads, T, dim]
        if k is None or k.dim() != 4:
            return LayerFacts(NONE)
        window = int(getattr(layer, "sliding_window", 0) or 0) if "Sliding" in name else 0
        kind = (SLIDING if window else FULL) + (WITH_STATE if name.startswith("LinearAttention") else "")
        return LayerFacts(kind, window, k.shape[1], k.shape[3], v.shape[1], v.shape[3], state)
    if name == "LinearAttentionLayer":
        return LayerFacts(STATE, state_bytes=state)
    if name == "DummyLayer":
        return LayerFacts(NONE)
    return LayerFacts(name)


PROBE_TOKENS = 3


def probe(model) -> tuple[tuple[LayerFacts, ...], str | None]:
    """Per layer, what the model caches (one three-token forward with transformers' ``DynamicCache``), and
    why the cache would not be the whole story (one line), if it is not."""
    from transformers import DynamicCache

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    device = next(model.parameters()).device
    cache = DynamicCache(config=config)
    planned = len(cache.layers)
    before = _module_tensors(model)
    ids = torch.tensor([[1, 2, 3]], dtype=torch.long, device=device)  # [1, PROBE_TOKENS]
    with torch.inference_mode():
        model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS, device=device)[None], cache=cache,
              use_cache=True)
    facts = tuple(_classify(layer) for layer in cache.layers)
    return facts, _probe_refusal(model, cache, planned, before, facts)


def _module_tensors(model) -> dict[str, int]:
    """Plain tensor attributes of modules (not parameters or buffers), by id: where some models keep state."""
    return {f"{n}.{a}": id(v) for n, m in model.named_modules() for a, v in vars(m).items()
            if isinstance(v, torch.Tensor)}


def _probe_refusal(model, cache, planned: int, before: dict[str, int], facts) -> str | None:
    """What the forward did outside the cache layers transformers planned for (each seen in a model of
    transformers 5.24: a looped model that runs its layers twice, RecurrentGemma's state in module
    attributes, CPM-Ant's learned prompt tokens cached in front of the text)."""
    states = any(base_kind(f.kind) == STATE or f.kind.endswith(WITH_STATE) for f in facts)
    if states and planned and len(cache.layers) != planned:  # state layers are rebuilt from the config's plan
        return (f"the forward cached {len(cache.layers)} layers where the configuration plans {planned} "
                "(layers run more than once) and some hold a recurrent state: not supported yet")
    new = sorted(n for n, i in _module_tensors(model).items() if before.get(n) != i)
    if new:
        return f"the model keeps state in its modules ({new[0]}), outside the cache: not supported yet"
    held = {int(layer.keys.shape[2]) for layer, f in zip(cache.layers, facts) if f.kind.startswith(FULL)}
    if held - {PROBE_TOKENS}:
        return (f"the model caches {max(held)} tokens for {PROBE_TOKENS} it was given (tokens of its own in "
                "front of the text): not supported yet")
    return None


def refusal(facts: tuple[LayerFacts, ...]) -> str | None:
    """Why this engine cannot run a model with these layers (one line), or None."""
    kinds = sorted({f.kind for f in facts})
    unknown = [k for k in kinds if base_kind(k) not in (FULL, SLIDING, STATE, NONE)]
    if unknown:
        return f"layers cached as {', '.join(unknown)} are not supported"
    attn = [f for f in facts if f.attention]
    if not attn:
        return "no attention layer caches keys and values: nothing for the KV cache to hold"
    shapes = {(f.k_heads, f.k_dim, f.v_heads, f.v_dim) for f in attn}
    if len(shapes) > 1:
        return f"attention layers cache keys/values of {len(shapes)} different shapes: not supported yet"
    return None


def sharing_refusal(config) -> str | None:
    """Layers that read another layer's keys and values (Gemma 3n's KV sharing) need that layer's cache
    object as transformers builds it: not supported yet. MLP-only layers (which cache nothing) are fine."""
    if int(getattr(config, "num_kv_shared_layers", 0) or 0) > 0:
        return "some layers reuse another layer's keys and values (KV sharing): not supported yet"
    return None


def info_fields(facts: tuple[LayerFacts, ...], elem_bytes: int, config=None, probe_refusal: str | None = None) -> dict:
    """``ModelInfo`` fields from the probe: layer kinds, windows, real K/V widths, bytes per token, state."""
    attn = [f for f in facts if f.attention]
    first = attn[0] if attn else LayerFacts(NONE)
    return dict(
        layer_kinds=tuple(f.kind for f in facts),
        windows=tuple(f.window for f in facts),
        k_heads=first.k_heads, k_dim=first.k_dim, v_heads=first.v_heads, v_dim=first.v_dim,
        state_bytes=sum(f.state_bytes for f in facts),
        num_kv_heads=first.k_heads,
        head_dim=first.k_dim,
        kv_bytes_per_token=sum((f.k_heads * f.k_dim + f.v_heads * f.v_dim) * elem_bytes for f in attn),
        unsupported=(probe_refusal or refusal(facts) or (sharing_refusal(config) if config is not None else None)
                     or ""),
    )


def attention_impl(model) -> str:
    """The attention the model runs with when no policy needs scores: what it was loaded with ("sdpa" where
    transformers supports it for the class; "eager" for e.g. Gemma 2's softcapping, gpt-oss's sinks)."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    return impl if impl in ("sdpa", "eager") else "eager"
