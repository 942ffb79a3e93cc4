"""Memory estimate before loading: weights + KV cache at a chosen context, from ``config.json`` and the
weight files' sizes (no torch). Used by the models dialog for its fit warning."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.kv.paged import sizes  # the engine's own formulas, torch-free

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DEMO = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 128,
        "torch_dtype": "float32", "max_position_embeddings": 2048}
DEMO_WEIGHTS_BYTES = 3_042_880


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of weights and of a full-precision KV cache holding ``context`` tokens."""

    weights_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    context: int
    max_context: int
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    def kv_bytes_as(self, kind: str, page_size: int = 16) -> int:
        """KV bytes at ``context`` tokens with K and V held as ``kind`` (int8, int4, tq4, tq3, tq2) pages."""
        per_token = sum(sizes.bytes_per_token(kind, role, self.kv_heads, self.head_dim, page_size)
                        for role in ("k", "v"))
        return int(self.layers * per_token * self.context)

    def fits(self, device_bytes: int, headroom: float = 0.9) -> bool:
        return self.total_bytes <= device_bytes * headroom


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


def estimate(config: dict, stored_weights_bytes: int, context: int, quantization: str = "none",
             device: str = "cpu") -> MemoryEstimate:
    """Estimate from a parsed ``config.json`` and the size of the stored weights.

    Compute dtype as the engine's loader picks it: float32 on CPU, else the checkpoint's half type or float16;
    ``quantization`` "bf16" (the weights choice "bfloat16") computes in bfloat16 everywhere. 8-bit weights
    take ~1 byte per parameter, 4-bit ~0.56 (codes + scales); the KV cache stays in the compute dtype.
    """
    c = _text_config(config)
    stored_dtype = str(c.get("torch_dtype") or c.get("dtype") or "float32").replace("torch.", "")
    stored_b = _DTYPE_BYTES.get(stored_dtype, 4)
    compute_b = 4 if device == "cpu" else min(stored_b, 2)  # as the loader: fp32 on CPU, else fp16/bf16
    if quantization == "bf16":  # the weights choice "bfloat16": weights and KV in bf16 on any device
        compute_b = 2
    params = stored_weights_bytes / stored_b
    per_param = {"none": compute_b, "int8": 1.0, "nf4": 0.56}.get(quantization, compute_b)
    layers = int(c.get("num_hidden_layers") or c.get("n_layer") or 0)
    q_heads = int(c.get("num_attention_heads") or c.get("n_head") or 1)
    kv_heads = int(c.get("num_key_value_heads") or q_heads)
    hidden = int(c.get("hidden_size") or c.get("n_embd") or 0)
    # bitsandbytes leaves the embeddings and the output head in the compute dtype: in Qwen2.5-0.5B they are
    # 136M of 494M parameters, and counting them at 0.56 bytes would under-estimate NF4 weights by ~40%
    embed = int(c.get("vocab_size") or 0) * hidden * (1 if c.get("tie_word_embeddings", True) else 2)
    embed = min(embed, int(params)) if quantization in ("int8", "nf4") else 0
    head_dim = int(c.get("head_dim") or (hidden // max(q_heads, 1)))
    max_ctx = int(c.get("max_position_embeddings") or c.get("n_positions") or context)
    ctx = min(context, max_ctx) if max_ctx else context
    full, sliding, window = _layer_counts(c, layers)
    per_layer = 2 * kv_heads * head_dim * compute_b
    per_token = per_layer * (full + sliding)
    kv = per_layer * (full * ctx + sliding * min(ctx, window - 1))  # sliding layers: the window less the query
    return MemoryEstimate(int(embed * compute_b + (params - embed) * per_param), kv, per_token, ctx, max_ctx, full + sliding, kv_heads, head_dim)


def _layer_counts(c: dict, layers: int) -> tuple[int, int, int]:
    """(full-attention layers, sliding-window layers, window) from ``layer_types`` as transformers reads it;
    recurrent / convolution layers of hybrid models hold no KV."""
    types = c.get("layer_types")
    window = int(c.get("sliding_window") or c.get("attention_chunk_size") or 0)
    if not isinstance(types, list) or not types:
        return layers, 0, 0
    sliding = sum(1 for t in types if t in ("sliding_attention", "chunked_attention")) if window else 0
    full = sum(1 for t in types if t == "full_attention") + (0 if window else
                                                             sum(1 for t in types if t.endswith("_attention")
                                                                 and t != "full_attention"))
    return full, sliding, window


def estimate_folder(folder: str | Path, context: int, quantization: str = "none", device: str = "cpu") -> MemoryEstimate:
    """Estimate for a local model folder. Raises ``OSError``/``ValueError`` if it has no readable config."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    if not weights:
        weights = sum(p.stat().st_size for p in folder.glob("*.bin"))
    return estimate(config, weights, context, quantization, device)


def estimate_gguf(path: str | Path, context: int, quantization: str = "none", device: str = "cpu"):
    """``(estimate, header facts)`` of a GGUF file, from its header (weights as loaded: dequantized). Raises the
    engine's one-line ``EngineError`` for a file that cannot be opened."""
    from engine.model.gguf_file import read_gguf

    info = read_gguf(path)
    return estimate(info.config(), info.n_params * 4, context, quantization, device), info


def estimate_demo(context: int, device: str = "cpu") -> MemoryEstimate:
    return estimate(DEMO, DEMO_WEIGHTS_BYTES, context, "none", device)
