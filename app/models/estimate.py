"""The models dialog's memory verdict before loading: the engine's own (``engine.model.fit``) for the chosen files,
weights choice and device, in the memory free now — the weights as they will be held, the KV cache's bytes per
token at every precision, the longest context that fits. Torch-free to import (the dialog opens before the model
libraries load); a GGUF's plan asks the GGUF loader what it keeps."""

from __future__ import annotations

from pathlib import Path

from engine.config import ModelSpec
from engine.model import fit
from engine.model.weights_plan import Held, WeightsPlan

DEMO = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 128,
        "intermediate_size": 256, "vocab_size": 512, "torch_dtype": "float32", "max_position_embeddings": 2048}
DEMO_WEIGHTS_BYTES = 3_042_880


def spec(source: str, weights: str, device: str) -> ModelSpec:
    """The spec the dialog's "weights" choice loads (``app.settings.cache_settings.spec_for``)."""
    from app.settings.cache_settings import spec_for

    return spec_for(source, weights, device)


def available(device: str, environment: dict | None = None) -> tuple[int, str] | None:
    """Free memory for the model on ``device``: the GPU's as the engine reported it (None until it has), else the
    free RAM (``KVSCOPE_AVAILABLE_MEMORY`` when set)."""
    env = environment or {}
    if device == "cuda":
        import os

        if os.environ.get(fit.ENV, "").strip():
            return fit.available_memory("cpu")
        free = int(env.get("device_free_bytes") or env.get("device_total_bytes") or 0)
        return (max(0, free - fit.HEADROOM), "free GPU memory") if free else None
    return fit.available_memory(device)


def weights(path: str | Path, weights: str, device: str) -> tuple[dict, WeightsPlan, str]:
    """(config, how the weights will be held, compute dtype) of the model folder or GGUF file at ``path``, from its
    headers (``engine.model.fit.weights_for``); ``EngineError`` (one line) for files that cannot be read."""
    path = Path(path)
    return fit.weights_for(path, spec(str(path), weights, device), device)


def verdict(path: str | Path, weights_choice: str, device: str, free: tuple[int, str] | None = None,
            planned: tuple[dict, WeightsPlan, str] | None = None) -> fit.Fit:
    """The verdict for the model at ``path`` in ``free`` memory (None: measured now, ``available``); ``planned``:
    its ``weights`` already read."""
    free = free or available(device) or (0, "free GPU memory (not known yet)")
    config, plan, dtype = planned or weights(path, weights_choice, device)
    return fit.estimate(Path(path).name, config, plan, device, dtype, free[0], free[1])


def verdict_demo(device: str, free: tuple[int, str] | None = None) -> fit.Fit:
    """The random-weight demo model (built in memory: float32 weights, no file)."""
    free = free or available(device) or (0, "free GPU memory (not known yet)")
    params = DEMO_WEIGHTS_BYTES // 4
    plan = WeightsPlan("F32", "F32", Held.READ, params, DEMO_WEIGHTS_BYTES, 0, DEMO["hidden_size"] ** 2)
    return fit.estimate("demo", DEMO, plan, device, "float32", free[0], free[1])
