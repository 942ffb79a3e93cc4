"""How a model's cached keys carry their positions (RoPE layout, per layer), and moving them to new positions.

Keys are cached after RoPE. StreamingLLM eviction and the truncate-middle / rolling overflow modes compact the
cache and move each kept key from its old position to a new one: ``k' = R(Δ)·k`` with Δ = new − old. That is
exact only when we rotate exactly as the model's own ``apply_rotary_pos_emb`` did, on each layer:

* frequencies: the rotary module's own ``inv_freq`` buffer (after linear / llama3 / yarn / proportional scaling,
  in the dtype the model holds it), chosen by the layer's type where the module keeps one set per type (Gemma 3:
  ``sliding_attention_inv_freq`` / ``full_attention_inv_freq``);
* rotary width: only the first ``rotary_dim`` channels of a head are rotated by partial-rotary models (phi,
  gpt_neox, stablelm, persimmon, glm4); the rest pass through;
* pairing: channel i pairs with i + R/2 (llama, neox: ``rotate_half`` on halves) or with its neighbour
  (cohere, glm4: pairs (2i, 2i+1));
* layers without RoPE (SmolLM3's ``no_rope_layers``, Cohere 2's global layers) are left alone, and so are
  layers that cache no keys (the recurrent / convolution layers of LFM2, Qwen3-Next, ...: ``keyless``);
* multi-head latent attention (DeepSeek V2/V3 and kin) caches a position-free latent as its "key" and the
  small shared rotary key ``k_rot`` as its "value" (``role`` "v"): only that is re-rotated.

Nothing is guessed per model type. The attention class's ``forward`` source is read (``ast``) to find where it
calls ``apply_rotary_pos_emb`` or a variant (always, or under an ``if`` on attributes of the attention module,
which is then evaluated per layer), which tensor it rotates (the cached key, ``key[..., :self.rotary_ndims]``, or
MLA's cached rotary key: ``engine.kv.store.rope_source``), and that function is then probed with the rotary
module's own cos/sin to learn the width and pairing. Anything this cannot read is refused with a reason rather
than rotated wrongly. ``attention_scaling`` (yarn's mscale) is
multiplied into cos/sin, so it is already in the cached key and cancels: ``R(Δ)·s·R(p)k = s·R(p+Δ)k``.
"""

from __future__ import annotations

import ast
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.store.rope_source import APPLY as _APPLY
from engine.kv.store.rope_source import eval_condition, site

# rope types whose inv_freq is fixed once built (``seq_len`` unused by their init functions in transformers).
# "dynamic" recomputes inv_freq when the sequence grows and "longrope" swaps short/long factors at the
# original context length, so keys cached earlier carry other frequencies: refused.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
# p, then p + Δ for two Δ: angles up to 7 rad at the first frequency, which tell both pairings apart
_PROBE_POSITIONS = (3, 5, -4)


@dataclass(frozen=True)
class LayerRope:
    """How one layer's cached keys were rotated."""

    inv_freq: torch.Tensor  # [R/2] float64 on CPU: the rotary module's own frequencies
    rotary_dim: int  # R: channels [0, R) of each head are rotated, [R, D) pass through
    interleaved: bool  # pairs (2i, 2i+1) (cohere, glm) instead of (i, i + R/2) (llama, neox)
    role: str = "k"  # the cached tensor that carries the position: "k", or "v" for MLA's rotary key


# model -> {keyless layers: list[LayerRope | None] | str}
_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rerotation_refusal(model, keyless: frozenset[int] = frozenset()) -> str | None:
    """Why cached keys of ``model`` cannot be moved to new positions exactly (one user-facing line), or None.

    ``keyless``: model layers that cache no keys (recurrent / convolution layers): nothing to read there.
    Reasons: no RoPE at all (absolute positions, ALiBi), RoPE scaling whose frequencies change with length
    (dynamic NTK, longrope), or a rotary module / attention code this module cannot read. Cheap after the first
    call: the analysis (a little source parsing, one tiny probe per layer kind, no model forward) is cached per
    model object. Call it before choosing a StreamingLLM policy or a truncate-middle / rolling overflow mode.
    """
    layout = rope_layout_or_reason(model, keyless)
    return layout if isinstance(layout, str) else None


def rope_layout_or_reason(model, keyless: frozenset[int] = frozenset()) -> list[LayerRope | None] | str:
    """Per model layer, how its keys were rotated (None: no RoPE on that layer); or the refusal reason."""
    keyless = frozenset(keyless)
    try:
        return _layouts[model][keyless]
    except (KeyError, TypeError):
        pass
    try:
        layout = _analyse(model, keyless)
    except Exception as e:  # noqa: BLE001 - any surprise in a model's code is a refusal, never a crash
        layout = _unreadable(_model_type(model), f"reading how it applies RoPE failed ({type(e).__name__}: {e})")
    try:
        _layouts.setdefault(model, {})[keyless] = layout
    except TypeError:
        pass
    return layout


class Rerotator:
    """Moves cached (post-RoPE) keys of a model to new positions, layer by layer, exactly as the model's own
    ``apply_rotary_pos_emb`` would have rotated them there. Raises ``ValueError`` (the ``rerotation_refusal``
    reason) for models whose keys cannot be re-rotated."""

    def __init__(self, model, keyless: frozenset[int] = frozenset()) -> None:
        layout = rope_layout_or_reason(model, keyless)
        if isinstance(layout, str):
            raise ValueError(layout)  # noqa: TRY004 - the model is refused, not the argument's type
        self.layers: list[LayerRope | None] = layout
        roles = {s.role for s in layout if s is not None}
        # one cached role carries positions in every layer ("k"; "v" on MLA models): compaction rotates that one
        self.role = roles.pop() if len(roles) == 1 else "k"

    @property
    def moves(self) -> bool:
        """Does any layer's cache carry positions (False: no RoPE anywhere, re-rotating changes nothing)?"""
        return any(s is not None for s in self.layers)

    def __call__(self, layer: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``k``: [H, n, D] cached keys (MLA: the cached rotary keys) of model layer ``layer``; ``delta``: [n]
        int position change of each token (new - old), or [H, n] where each head moved its own tokens (a per-head
        eviction). Returns [H, n, D] in ``k``'s dtype."""
        spec = self.layers[layer]
        if spec is None or not bool((delta != 0).any()):
            return k  # a NoPE layer's keys carry no position
        if k.shape[-1] < spec.rotary_dim or (spec.role == "v" and k.shape[-1] != spec.rotary_dim):
            raise ValueError(f"layer {layer}: keys of width {k.shape[-1]} for rotary width {spec.rotary_dim}")
        # angles in float64 on the CPU: exact for any Δ (float32 Δ·θ loses ~1e-4 rad at Δ≈4k), and MPS has no f64
        angles = delta.detach().cpu().double()[..., None] * spec.inv_freq  # [n, R/2] or [H, n, R/2]
        cos = angles.cos().to(device=k.device, dtype=torch.float32)  # [n, R/2] or [H, n, R/2]
        sin = angles.sin().to(device=k.device, dtype=torch.float32)
        return rotate(k.float(), cos, sin, spec.rotary_dim, spec.interleaved).to(k.dtype)


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
           interleaved: bool) -> torch.Tensor:
    """Rotate each channel pair of ``k[..., :rotary_dim]`` by the angle whose cos/sin are given.

    k [..., n, D]; cos/sin [n, R/2] (broadcast over leading dims). Returns [..., n, D]."""
    rot, rest = k[..., :rotary_dim], k[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]  # [..., n, R/2] each
    else:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    y1 = x1 * cos - x2 * sin  # [..., n, R/2]
    y2 = x2 * cos + x1 * sin
    out = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)  # [..., n, R]
    return torch.cat((out, rest), dim=-1)


# -- analysis -----------------------------------------------------------------------------------------------
def _model_type(model) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)


def _unreadable(mt: str, detail: str) -> str:
    detail = " ".join(detail.split())  # one line, whatever an exception said
    return f"{mt}: {detail[:300]}: KV Scope cannot re-rotate its cached keys exactly"


def _analyse(model, keyless: frozenset[int]) -> list[LayerRope | None] | str:
    mt = _model_type(model)
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    layers = next((getattr(decoder, n) for n in ("layers", "h") if hasattr(decoder, n)), None)
    rot = _rotary_module(decoder)
    if rot is None:
        return _no_rope(model, decoder, layers, keyless)
    if isinstance(rot, str):
        return _unreadable(mt, rot)
    if not hasattr(rot, "rope_type"):  # e.g. gpt-j's own sin/cos table with rotate_every_two
        return _unreadable(mt, f"its rotary module {type(rot).__name__} is not a transformers RoPE module")
    types = rot.rope_type if isinstance(rot.rope_type, dict) else {None: rot.rope_type}
    for t in types.values():
        if "dynamic" in str(t) or t == "longrope":
            return (f"{mt} uses {t} RoPE scaling, whose frequencies change with the sequence length: its cached "
                    "keys cannot be re-rotated exactly")
        if t not in STATIC_ROPE_TYPES:
            return _unreadable(mt, f"it uses RoPE scaling '{t}', which KV Scope does not know")
    if not isinstance(layers, torch.nn.ModuleList):
        return _unreadable(mt, "its decoder layers cannot be found")
    layer_types = getattr(rot.config, "layer_types", None) if isinstance(rot.rope_type, dict) else None
    probed: dict[tuple, LayerRope | str] = {}
    out: list[LayerRope | None] = []
    for i, layer in enumerate(layers):
        if i in keyless:  # a recurrent / convolution layer: it caches no keys, nothing carries a position
            out.append(None)
            continue
        spec = _layer_rope(i, layer, rot, layer_types[i] if layer_types else None, probed)
        if isinstance(spec, str):
            return _unreadable(mt, spec)
        out.append(spec)
    return out


def _no_rope(model, decoder, layers, keyless: frozenset[int]) -> list[None] | str:
    """No rotary module. A hybrid whose attention has no position encoding at all (Jamba, Nemotron-H, Zamba:
    the recurrent layers carry the order) caches keys that no position is in: evicting needs no rotation, so
    every layer is None. Anything else (absolute embeddings, ALiBi, a plain model without RoPE) is refused."""
    why = _no_rope_reason(model, decoder)
    if keyless and "has no position encoding" in why and isinstance(layers, torch.nn.ModuleList):
        return [None] * len(layers)
    return why


def _rotary_module(decoder):
    """The decoder's rotary module; None when it has none; a message when it has several."""
    found = [m for m in decoder.children() if type(m).__name__.endswith("RotaryEmbedding")]
    if getattr(decoder, "rotary_emb", None) is not None and len(found) <= 1:
        return decoder.rotary_emb
    if len(found) == 1:
        return found[0]
    if found:
        return f"several rotary modules ({', '.join(sorted(type(m).__name__ for m in found))})"
    if any(type(m).__name__.endswith("RotaryEmbedding") for m in decoder.modules()):
        return "rotary modules inside the layers"
    return None


def _no_rope_reason(model, decoder) -> str:
    cfg = model.config
    attn_cfg = getattr(cfg, "attn_config", None)
    alibi = (cfg.model_type == "bloom" or bool(getattr(cfg, "alibi", False))
             or bool(getattr(attn_cfg, "alibi", False))
             or (isinstance(attn_cfg, dict) and bool(attn_cfg.get("alibi"))))
    if alibi:
        kind = "it uses ALiBi attention biases"
    elif any(n == "wpe" or "pos" in n for n, _ in decoder.named_children()):  # gpt2 wpe, opt embed_positions
        kind = "it uses absolute position embeddings"
    else:
        kind = "its attention has no position encoding"
    return (f"{cfg.model_type} has no rotary position embedding ({kind}): its cached keys cannot be moved to new "
            "positions")


def _layer_rope(i: int, layer, rot, layer_type: str | None, probed: dict) -> LayerRope | None | str:
    """How layer ``i`` rotated its keys (None: it does not), or why that cannot be told."""
    names = ("self_attn", "attention", "self_attention", "attn")
    attn = next((getattr(layer, n) for n in names if hasattr(layer, n)), None)
    if attn is None:
        return f"the attention of layer {i} cannot be found"
    if getattr(attn, "layer_idx", i) != i:  # a shared or reordered attention: our layer index is the cache's
        return f"layer {i} caches its keys as layer {attn.layer_idx}"
    where = site(type(attn))
    if isinstance(where, str):
        return where
    fn = where.fns[0]
    if where.condition is not None:
        on = eval_condition(where.condition, attn)
        if on is None:
            return (f"whether layer {i} applies RoPE cannot be told "
                    f"(`if {ast.unparse(where.condition)}` in {type(attn).__name__}.forward)")
        fn = where.fns[0 if on else 1]
    if fn is None:
        return None
    width = _rotated_width(attn, where)
    if not isinstance(width, int) or width <= 0:
        return f"the rotated width of layer {i}'s keys cannot be told"
    key = (layer_type, width, fn, where.role)
    if key not in probed:
        probed[key] = _probe(rot, layer_type, fn, width, where.role)
    return probed[key]


def _rotated_width(attn, where) -> int | None:
    """Channels of the rotated tensor: the head (or its first ``slice_attr`` channels); MLA's rotary key."""
    if where.role == "v":
        return getattr(attn, "qk_rope_head_dim", None)
    head_dim = getattr(attn, "head_dim", None) or getattr(attn, "head_size", None)
    return getattr(attn, where.slice_attr, None) if where.slice_attr else head_dim


def _probe(rot, layer_type: str | None, apply_fn, width: int, role: str = "k") -> LayerRope | str:
    """Learn rotary width and pairing from the model's own code: rotate one fixed key of ``width`` channels to
    positions p and p + Δ with the rotary module's cos/sin and the attention's own rotary function, and find the
    pairing under which rotating the first result by Δ gives the second. That is the pairing of the *cached*
    layout, which is what re-rotation acts on: DeepSeek V3 reads interleaved pairs and caches halves. No match
    means a layout this module does not know."""
    inv = rot.inv_freq if layer_type is None else getattr(rot, f"{layer_type}_inv_freq", None)
    if not isinstance(inv, torch.Tensor):
        return f"its rotary module {type(rot).__name__} has no inv_freq for {layer_type or 'its layers'}"
    inv64 = inv.detach().double().cpu()  # [R/2]
    r = 2 * inv64.numel()
    if r > width:
        return f"its rotary module has {inv64.numel()} frequencies for a rotated width of {width}"
    k = torch.randn(1, 1, 1, width, generator=torch.Generator().manual_seed(0))  # [B, H, n, D]
    try:
        at = {p: _rotated_at(rot, layer_type, apply_fn, k, p) for p in _PROBE_POSITIONS}  # p -> [1, D]
    except Exception as e:  # noqa: BLE001 - a signature or shape this module does not know
        return f"{_APPLY} of {type(rot).__name__} did not take a probe key ({type(e).__name__}: {e})"
    if any(v.shape != (1, width) for v in at.values()):
        return f"{_APPLY} of {type(rot).__name__} gave keys of another width than {width}"
    p0 = _PROBE_POSITIONS[0]
    for interleaved in (False, True):
        if all(torch.allclose(_turn(at[p0], (p - p0) * inv64, r, interleaved), at[p], rtol=1e-4, atol=1e-4)
               for p in _PROBE_POSITIONS[1:]):
            return LayerRope(inv64, r, interleaved, role)
    return f"{_APPLY} rotates keys in a way KV Scope does not know (neither halves nor interleaved pairs)"


def _rotated_at(rot, layer_type: str | None, apply_fn, k: torch.Tensor, p: int) -> torch.Tensor:
    """``k`` [1, 1, 1, D] as the model rotates it to position ``p``: [1, D] float64 on the CPU."""
    dev = (rot.inv_freq if layer_type is None else getattr(rot, f"{layer_type}_inv_freq")).device
    pos = torch.full((1, 1), p, dtype=torch.long, device=dev)  # position_ids [B, n]
    x = torch.zeros(1, device=dev)  # only its device and dtype are read
    with torch.no_grad():
        emb = rot(x, pos) if layer_type is None else rot(x, pos, layer_type)  # cos, sin: [1, 1, R] each
        k = k.clone().to(dev)
        if isinstance(emb, torch.Tensor) and emb.is_complex():  # DeepSeek V2: freqs_cis [1, 1, R/2]
            out = apply_fn(k, k.clone(), emb)
        else:
            out = apply_fn(k, k.clone(), *emb)
    return out[1].detach().double().cpu()[0, 0]


def _turn(k: torch.Tensor, angles: torch.Tensor, r: int, interleaved: bool) -> torch.Tensor:
    """``k`` [1, D] rotated by ``angles`` [R/2] (float64)."""
    return rotate(k, angles.cos()[None], angles.sin()[None], r, interleaved)


# -- other layer kinds ---------------------------------------------------------------------------------------
def keyless_layers(kinds) -> frozenset[int]:
    """Model layers that cache no keys (``ModelInfo.layer_kinds`` "state": recurrent / convolution, "none": MLP
    only): they carry no positions, so re-rotation has nothing to read or move there."""
    return frozenset(i for i, k in enumerate(kinds or ()) if k in ("state", "none"))


def shift_all(store, layers: list[int], delta: int, rerotator: Rerotator) -> None:
    """Re-rotate every key ``store`` holds by the same ``delta`` positions, in place (its local layer j is model
    layer ``layers[j]``). A sliding window goes on from keys shifted this way exactly as it would have: RoPE
    attention depends on query - key positions only, and queries arrive shifted by the same ``delta``."""
    n = store.num_tokens
    if n == 0 or delta == 0 or all(rerotator.layers[m] is None for m in layers):
        return
    d = torch.full((n,), delta, dtype=torch.int64)

    def turn(layer: int, k: torch.Tensor, idx) -> torch.Tensor:
        return rerotator(layers[layer], k, d[:len(idx)])

    turn.role = rerotator.role  # type: ignore[attr-defined] - read by ``KVStore.compact``
    store.compact([np.arange(n)] * store.num_layers, turn, 0)
