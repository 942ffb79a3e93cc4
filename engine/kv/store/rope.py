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
* layers without RoPE (SmolLM3's ``no_rope_layers``, Cohere 2's global layers) are left alone.

Nothing is guessed per model type. The attention class's ``forward`` source is read (``ast``) to find where it
calls ``apply_rotary_pos_emb`` (always, or under an ``if`` on attributes of the attention module, which is then
evaluated per layer), which key tensor it rotates (the cached one, or ``key[..., :self.rotary_ndims]``), and
that function is then probed with the rotary module's own cos/sin to learn the width and pairing. Anything this
cannot read is refused with a reason rather than rotated wrongly. ``attention_scaling`` (yarn's mscale) is
multiplied into cos/sin, so it is already in the cached key and cancels: ``R(Δ)·s·R(p)k = s·R(p+Δ)k``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

# rope types whose inv_freq is fixed once built (``seq_len`` unused by their init functions in transformers).
# "dynamic" recomputes inv_freq when the sequence grows and "longrope" swaps short/long factors at the
# original context length, so keys cached earlier carry other frequencies: refused.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
_APPLY = "apply_rotary_pos_emb"
_PROBE_POS = 3  # angles up to 3 rad: distinguishes both pairings and any scaling


@dataclass(frozen=True)
class LayerRope:
    """How one layer's cached keys were rotated."""

    inv_freq: torch.Tensor  # [R/2] float64 on CPU: the rotary module's own frequencies
    rotary_dim: int  # R: channels [0, R) of each head are rotated, [R, D) pass through
    interleaved: bool  # pairs (2i, 2i+1) (cohere, glm) instead of (i, i + R/2) (llama, neox)


@dataclass(frozen=True)
class _Site:
    """Where a attention class applies RoPE, read from its ``forward``."""

    apply_fn: Callable
    condition: ast.expr | None  # RoPE only under ``if <condition>`` (on ``self``); None: always
    negate: bool  # the call sits in the ``else`` branch
    slice_attr: str | None  # keys rotated as ``key[..., :self.<slice_attr>]`` (phi-style); None: whole key


_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> list[LayerRope | None] | str
_sites: dict[type, _Site | str] = {}


def rerotation_refusal(model) -> str | None:
    """Why cached keys of ``model`` cannot be moved to new positions exactly (one user-facing line), or None.

    Reasons: no RoPE at all (absolute positions, ALiBi), RoPE scaling whose frequencies change with length
    (dynamic NTK, longrope), or a rotary module / attention code this module cannot read. Cheap after the first
    call: the analysis (a little source parsing, one tiny probe per layer kind, no model forward) is cached per
    model object. Call it before choosing a StreamingLLM policy or a truncate-middle / rolling overflow mode.
    """
    layout = rope_layout_or_reason(model)
    return layout if isinstance(layout, str) else None


def rope_layout_or_reason(model) -> list[LayerRope | None] | str:
    """Per model layer, how its keys were rotated (None: no RoPE on that layer); or the refusal reason."""
    try:
        return _layouts[model]
    except (KeyError, TypeError):
        pass
    try:
        layout = _analyse(model)
    except Exception as e:  # noqa: BLE001 - any surprise in a model's code is a refusal, never a crash
        layout = _unreadable(_model_type(model), f"reading how it applies RoPE failed ({type(e).__name__}: {e})")
    try:
        _layouts[model] = layout
    except TypeError:
        pass
    return layout


class Rerotator:
    """Moves cached (post-RoPE) keys of a model to new positions, layer by layer, exactly as the model's own
    ``apply_rotary_pos_emb`` would have rotated them there. Raises ``ValueError`` (the ``rerotation_refusal``
    reason) for models whose keys cannot be re-rotated."""

    def __init__(self, model) -> None:
        layout = rope_layout_or_reason(model)
        if isinstance(layout, str):
            raise ValueError(layout)  # noqa: TRY004 - the model is refused, not the argument's type
        self.layers: list[LayerRope | None] = layout

    def __call__(self, layer: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``k``: [H, n, D] cached keys of model layer ``layer``; ``delta``: [n] int position change of each
        token (new - old). Returns [H, n, D] in ``k``'s dtype."""
        spec = self.layers[layer]
        if spec is None or not bool((delta != 0).any()):
            return k  # a NoPE layer's keys carry no position
        if k.shape[-1] < spec.rotary_dim:
            raise ValueError(f"layer {layer}: keys of width {k.shape[-1]} < rotary width {spec.rotary_dim}")
        # angles in float64 on the CPU: exact for any Δ (float32 Δ·θ loses ~1e-4 rad at Δ≈4k), and MPS has no f64
        angles = delta.detach().cpu().double()[:, None] * spec.inv_freq[None]  # [n, R/2]
        cos = angles.cos().to(device=k.device, dtype=torch.float32)  # [n, R/2]
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


def _analyse(model) -> list[LayerRope | None] | str:
    mt = _model_type(model)
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    rot = _rotary_module(decoder)
    if rot is None:
        return _no_rope_reason(model, decoder)
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
    layers = next((getattr(decoder, n) for n in ("layers", "h") if hasattr(decoder, n)), None)
    if not isinstance(layers, torch.nn.ModuleList):
        return _unreadable(mt, "its decoder layers cannot be found")
    layer_types = getattr(rot.config, "layer_types", None) if isinstance(rot.rope_type, dict) else None
    probed: dict[tuple, LayerRope | str] = {}
    out: list[LayerRope | None] = []
    for i, layer in enumerate(layers):
        spec = _layer_rope(i, layer, rot, layer_types[i] if layer_types else None, probed)
        if isinstance(spec, str):
            return _unreadable(mt, spec)
        out.append(spec)
    return out


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
    site = _site(type(attn))
    if isinstance(site, str):
        return site
    if site.condition is not None:
        on = _eval_condition(site.condition, attn)
        if on is None:
            return (f"whether layer {i} applies RoPE cannot be told "
                    f"(`if {ast.unparse(site.condition)}` in {type(attn).__name__}.forward)")
        if on == site.negate:
            return None
    head_dim = getattr(attn, "head_dim", None) or getattr(attn, "head_size", None)
    width = getattr(attn, site.slice_attr, None) if site.slice_attr else head_dim
    if not isinstance(width, int) or width <= 0:
        return f"the rotated width of layer {i}'s keys cannot be told"
    key = (layer_type, width, site.apply_fn)
    if key not in probed:
        probed[key] = _probe(rot, layer_type, site.apply_fn, width)
    return probed[key]


def _probe(rot, layer_type: str | None, apply_fn: Callable, width: int) -> LayerRope | str:
    """Learn rotary width and pairing from the model's own code: rotate a fixed key of ``width`` channels to
    position ``_PROBE_POS`` with the rotary module's cos/sin and the attention's ``apply_rotary_pos_emb``, and
    match the result against both pairings. A mismatch means a layout this module does not know."""
    inv = rot.inv_freq if layer_type is None else getattr(rot, f"{layer_type}_inv_freq", None)
    if not isinstance(inv, torch.Tensor):
        return f"its rotary module {type(rot).__name__} has no inv_freq for {layer_type or 'its layers'}"
    dev = inv.device
    pos = torch.full((1, 1), _PROBE_POS, dtype=torch.long, device=dev)  # position_ids [B, n]
    x = torch.zeros(1, device=dev)  # only its device and dtype are read
    k = torch.randn(1, 1, 1, width, generator=torch.Generator().manual_seed(0))  # [B, H, n, D]
    try:
        with torch.no_grad():
            cos, sin = rot(x, pos) if layer_type is None else rot(x, pos, layer_type)  # [1, 1, R]
            out = apply_fn(k.clone().to(dev), k.clone().to(dev), cos, sin)
        k_out = out[1].detach().double().cpu()[0, 0]  # [1, D]
    except Exception as e:  # noqa: BLE001 - a signature or shape this module does not know
        return f"{_APPLY} of {type(rot).__name__} did not take a probe key ({type(e).__name__}: {e})"
    cos, sin = cos.double().cpu().reshape(-1), sin.double().cpu().reshape(-1)  # [R]
    inv64 = inv.detach().double().cpu()  # [R/2]
    r = 2 * inv64.numel()
    # cos/sin come per channel (R: cat or repeat_interleave of the angles) or per pair (R/2: gpt-oss)
    if cos.numel() not in (r, r // 2) or r > width or k_out.shape != (1, width):
        return f"its rotary module gives {cos.numel()} angles for {inv64.numel()} frequencies (head size {width})"
    scale = torch.hypot(cos[0], sin[0])  # attention_scaling, already multiplied into cached keys
    angles = _PROBE_POS * inv64[None]  # [1, R/2]
    for interleaved in (False, True):
        want = rotate(k[0, 0].double(), angles.cos() * scale, angles.sin() * scale, r, interleaved)  # [1, D]
        if torch.allclose(k_out, want, rtol=1e-4, atol=1e-4):
            return LayerRope(inv64, r, interleaved)
    return f"{_APPLY} rotates keys in a way KV Scope does not know (neither halves nor interleaved pairs)"


# -- reading the attention's forward ---------------------------------------------------------------------------
_SAFE_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.Compare, ast.Is,
               ast.IsNot, ast.Eq, ast.NotEq, ast.Name, ast.Attribute, ast.Constant, ast.Load)


def _site(cls: type) -> _Site | str:
    if cls not in _sites:
        try:
            _sites[cls] = _read_site(cls)
        except (OSError, TypeError, SyntaxError, IndexError) as e:
            _sites[cls] = f"the source of {cls.__name__}.forward cannot be read ({type(e).__name__})"
    return _sites[cls]


def _is_apply(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == _APPLY


def _read_site(cls: type) -> _Site | str:
    """Find the one ``q, k = apply_rotary_pos_emb(q, k, cos, sin)`` in ``cls.forward`` (top level, or directly
    under one ``if``/``else``), which key it rotates and whether that is the key that goes into the cache."""
    owner = next(c for c in cls.__mro__ if "forward" in vars(c))
    fn = inspect.unwrap(vars(owner)["forward"])
    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    where = f"{cls.__name__}.forward"
    found = []  # (statement, condition, negate)
    for stmt in body:
        if not any(_is_apply(n) for n in ast.walk(stmt)):
            continue
        if isinstance(stmt, ast.If):
            for branch, neg in ((stmt.body, False), (stmt.orelse, True)):
                found += [(s, stmt.test, neg) for s in branch if any(_is_apply(n) for n in ast.walk(s))]
        else:
            found.append((stmt, None, False))
    n_calls = sum(_is_apply(n) for n in ast.walk(ast.Module(body=body, type_ignores=[])))
    if len(found) != 1 or n_calls != 1:
        return f"{where} calls {_APPLY} {n_calls} times, or not in a plain statement"
    stmt, cond, neg = found[0]
    if not (isinstance(stmt, ast.Assign) and _is_apply(stmt.value) and len(stmt.value.args) >= 4
            and isinstance(stmt.value.args[1], ast.Name) and isinstance(stmt.targets[0], ast.Tuple)
            and ast.unparse(stmt.targets[0].elts[1]) == stmt.value.args[1].id):
        return f"{where} does not call {_APPLY} as `q, k = {_APPLY}(q, k, cos, sin)`"
    key = stmt.value.args[1].id
    cached = {n.args[0].id for n in ast.walk(ast.Module(body=body, type_ignores=[]))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update"
              and len(n.args) >= 2 and isinstance(n.args[0], ast.Name)}
    if len(cached) != 1:
        return f"{where}: KV Scope cannot find which keys go into the cache"
    apply_fn = fn.__globals__.get(_APPLY)
    if not callable(apply_fn):
        return f"{where}: {_APPLY} is not a module-level function"
    slice_attr = None if key in cached else _first_channels(body, key, next(iter(cached)))
    if key not in cached and slice_attr is None:
        return f"{where} rotates `{key}`, which is not the cached key nor its first channels"
    return _Site(apply_fn, cond, neg, slice_attr)


def _first_channels(body: list, key: str, cached: str) -> str | None:
    """X when ``key = cached[..., : self.X]`` and later ``cached = torch.cat((key, rest), dim=-1)`` (phi,
    stablelm, persimmon rotate only the first ``rotary_ndims`` channels, in the attention)."""
    pairs = []  # (target, value) with tuple assignments unpacked
    for n in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            t, v = n.targets[0], n.value
            if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
                pairs += list(zip(t.elts, v.elts))
            else:
                pairs.append((t, v))
    attr = None
    for t, v in pairs:
        if ast.unparse(t) == key and isinstance(v, ast.Subscript) and ast.unparse(v.value) == cached:
            s = v.slice
            if (isinstance(s, ast.Tuple) and len(s.elts) == 2 and ast.unparse(s.elts[0]) == "..."
                    and isinstance(s.elts[1], ast.Slice) and s.elts[1].lower is None and s.elts[1].step is None
                    and ast.unparse(s.elts[1].upper or ast.Constant(None)).startswith("self.")):
                attr = ast.unparse(s.elts[1].upper)[len("self."):]
    rebuilt = any(ast.unparse(t) == cached and isinstance(v, ast.Call) and ast.unparse(v.func).endswith("cat")
                  and v.args and isinstance(v.args[0], (ast.Tuple, ast.List)) and v.args[0].elts
                  and ast.unparse(v.args[0].elts[0]) == key for t, v in pairs)
    return attr if rebuilt and attr is not None and attr.isidentifier() else None


def _eval_condition(expr: ast.expr, attn) -> bool | None:
    """Evaluate an ``if`` test that reads only attributes of ``self`` (the attention module) and compares them
    (``self.use_rope``, ``self.sliding_window is not None or self.force_rope``); None for anything else."""
    tree = ast.Expression(body=expr)
    for n in ast.walk(tree):
        if not isinstance(n, _SAFE_NODES) or (isinstance(n, ast.Name) and n.id != "self"):
            return None
    code = compile(tree, "<rope condition>", "eval")  # only `self.<attr>` reads and comparisons, checked above
    try:
        return bool(eval(code, {"__builtins__": {}}, {"self": attn}))
    except Exception:  # noqa: BLE001 - a missing attribute: cannot tell
        return None
