"""A zoo of tiny random-weight models, one per causal-LM type of transformers, and a probe of their caches.

``tiny_model(t)`` builds a seeded float32 model of the tiny config of type ``t`` (table in
``arch_configs``); ``probe(model)`` runs transformers' own forward with ``DynamicCache(config=...)`` on 3
tokens and reports what each cache layer holds: this is what kvscope's cache must be able to replace.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from arch_configs import GENERIC, OVERRIDES, SKIPPED, WINDOW  # tests/engine is on sys.path (pytest, arch_report)

MODEL_TYPES: list[str] = [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in SKIPPED]
PROBE_TOKENS = 3


def _defaults(cfg) -> dict:
    """The config's fields as a dict, with ``attribute_map`` aliases (gpt2's ``n_embd`` as ``hidden_size``)."""
    d = cfg.to_dict()
    for alias, real in (getattr(cfg, "attribute_map", {}) or {}).items():
        if real in d:
            d.setdefault(alias, d[real])
    return d


def _kinds(seq) -> list:
    """Distinct entries in order of first appearance."""
    return list(dict.fromkeys(seq))


def tiny_kwargs(model_type: str) -> dict:
    """The keyword arguments for ``AutoConfig.for_model(model_type, **kw)``."""
    default = _defaults(AutoConfig.for_model(model_type))
    kw = {k: v for k, v in GENERIC.items() if k in default}
    if "kv_lora_rank" in default:  # MLA: one latent shared by all heads; head_dim names the rotary width
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
        if "head_dim" in default:
            kw["head_dim"] = kw["qk_rope_head_dim"]
    sw = default.get("sliding_window")
    if isinstance(sw, int) and not isinstance(sw, bool) and sw > 0:
        kw["sliding_window"] = WINDOW
    for name, val in default.items():  # special token ids must exist in the tiny vocabulary (an embedding's
        # padding_idx out of range fails the build)
        if name.endswith("token_id") and isinstance(val, int) and val >= GENERIC["vocab_size"]:
            kw[name] = 0
    # one layer of every kind the architecture has, in the order the real model first uses them
    layer_types = default.get("layer_types")
    if isinstance(layer_types, list) and len(set(layer_types)) > 1:
        kinds = _kinds(layer_types)
        kw["layer_types"], kw["num_hidden_layers"] = kinds, len(kinds)
    n = kw.get("num_hidden_layers", 2)
    for name in ("mlp_layer_types",):  # per-layer lists that must match the layer count
        if isinstance(default.get(name), list):
            kinds = _kinds(default[name])
            kw[name] = (kinds * n)[:n]
    kw.update(OVERRIDES.get(model_type, {}))
    # pass real field names: an alias (``attribute_map``) is applied after ``__post_init__`` has already derived
    # other fields from the default (zamba2's hybrid_layer_ids, dbrx's ffn_config.hidden_size)
    aliases = getattr(config_class(model_type), "attribute_map", {}) or {}
    return {aliases.get(k, k): v for k, v in kw.items()}


def config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def tiny_config(model_type: str):
    return AutoConfig.for_model(model_type, **tiny_kwargs(model_type))


def tiny_model(model_type: str, seed: int = 0):
    """``(model, config)``: seeded random float32 weights, eval mode, sdpa where transformers allows it."""
    cfg = tiny_config(model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
        except ValueError as e:  # e.g. gemma2 (softcapping), gpt_oss (sinks): transformers refuses sdpa
            if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e):
                raise
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    if model_type == "xmod":  # language adapters: one must be chosen before any forward
        model.set_default_language("en_XX")
    return model, model.config


def save_folder(model_type: str, folder, tokenizer_folder) -> None:
    """A model folder ``python -m engine generate --model`` can load: the tiny config of ``model_type`` with the
    vocabulary of the tokenizer in ``tokenizer_folder`` (stories260K's, 512 ids), seeded random weights
    (safetensors) and that tokenizer's files. For CLI checks and repro commands."""
    import json
    import shutil
    from pathlib import Path

    src = Path(tokenizer_folder)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    cfg = AutoConfig.for_model(model_type, **{**tiny_kwargs(model_type), "vocab_size": vocab})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(src / name, Path(folder) / name)


def _flat(name: str, val, out: dict, depth: int = 0) -> None:
    """Tensors inside ``val`` (tensor, dict, list/tuple, nested up to 3 deep) as ``out[name[i]...] = t``."""
    if isinstance(val, torch.Tensor):
        if val.numel() > 0:
            out[name] = val
    elif isinstance(val, dict) and depth < 3:
        for i, v in val.items():
            _flat(f"{name}[{i}]", v, out, depth + 1)
    elif isinstance(val, (list, tuple)) and depth < 3:
        for i, v in enumerate(val):
            _flat(f"{name}[{i}]", v, out, depth + 1)


def _tensors(obj) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, val in vars(obj).items():
        if not name.startswith("_") and name not in ("layers", "config"):
            _flat(name, val, out)
    return out


def _module_tensors(model) -> dict[str, torch.Tensor]:
    """Plain tensor attributes of modules (not parameters or buffers): where some models keep recurrent state."""
    return {f"{n}.{a}": v for n, m in model.named_modules() for a, v in vars(m).items() if isinstance(v, torch.Tensor)}


def _shapes(ts: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {n: list(t.shape) for n, t in ts.items()}


def _nbytes(ts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def _layer_row(layer) -> dict:
    row: dict = {"class": type(layer).__name__}
    ts = _tensors(layer)
    k, v = ts.pop("keys", None), ts.pop("values", None)
    if k is not None:  # [B, heads, T, dim]; MLA latents are [B, 1, T, rank]
        row["k"], row["stored"] = [k.shape[1], k.shape[-1]], int(k.shape[-2])
    if v is not None:
        row["v"] = [v.shape[1], v.shape[-1]]
    if getattr(layer, "sliding_window", None) is not None:
        row["sliding_window"] = int(layer.sliding_window)
    if ts:
        row["state"], row["state_bytes"] = _shapes(ts), _nbytes(ts)
    return row


def probe(model) -> dict:
    """Run HF's forward on ``PROBE_TOKENS`` tokens with ``DynamicCache(config=...)``; describe what is cached.

    ``layers``: per cache layer ``class``; ``k``/``v`` = [heads, head_dim] and ``stored`` tokens for attention
    layers; ``sliding_window``; ``state`` {name: shape} and ``state_bytes`` for conv/recurrent/indexer state.
    ``own_cache``: why DynamicCache was refused (then the model's own cache class is probed instead);
    ``cache_state``: tensors of such a cache outside its layers; ``output_state``: state returned in the output
    instead of a cache (rwkv); ``module_state``: state the forward left in module attributes (recurrent_gemma).
    """
    cfg = model.config
    vocab = cfg.get_text_config().vocab_size
    ids = (torch.arange(PROBE_TOKENS) + 3)[None] % vocab
    pos = torch.arange(PROBE_TOKENS)[None]
    own = None
    before = {n: id(t) for n, t in _module_tensors(model).items()}
    with torch.inference_mode():
        try:
            cache = DynamicCache(config=cfg)
            out = model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True)
        except (ValueError, AttributeError, TypeError) as e:  # models that insist on a cache class of their own
            own = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            out = model(input_ids=ids, use_cache=True)
            cache = getattr(out, "cache", None)
    layers = [_layer_row(layer) for layer in getattr(cache, "layers", None) or []]
    module_state = {n: t for n, t in _module_tensors(model).items() if before.get(n) != id(t)}
    output_state: dict[str, torch.Tensor] = {}
    _flat("state", getattr(out, "state", None), output_state)
    cache_state = _tensors(cache) if cache is not None and own else {}
    return {
        "model_type": cfg.model_type,
        "class": type(model).__name__,
        "attn_impl": cfg._attn_implementation,
        "params": sum(p.numel() for p in model.parameters()),
        "layer_types": list(getattr(cfg.get_text_config(), "layer_types", None) or []),
        "cache_class": type(cache).__name__,
        "own_cache": own,
        "layers": layers,
        "cache_state": _shapes(cache_state),
        "output_state": _shapes(output_state),
        "module_state": _shapes(module_state),
        "extra_state_bytes": _nbytes(cache_state) + _nbytes(output_state) + _nbytes(module_state),
    }


def summary(p: dict) -> str:
    """One line, e.g. ``1 DynamicSlidingWindowLayer(8) k[2,16]v[2,16] + 1 DynamicLayer k[2,16]v[2,16]``."""
    groups: dict[str, int] = {}
    for row in p["layers"]:
        key = row["class"]
        if "sliding_window" in row:
            key += f"({row['sliding_window']})"
        if "k" in row:
            key += f" k{row['k']}v{row.get('v')}".replace(", ", ",")
        if "state" in row:
            key += " state{" + ",".join(f"{n}:{'x'.join(map(str, s))}" for n, s in row["state"].items()) + "}"
        groups[key] = groups.get(key, 0) + 1
    parts = [f"{n} {k}" for k, n in groups.items()]
    for field in ("cache_state", "output_state", "module_state"):
        if p[field]:
            parts.append(f"{field}{{" + ",".join(f"{n}:{'x'.join(map(str, s))}" for n, s in p[field].items()) + "}")
    return " + ".join(parts)
