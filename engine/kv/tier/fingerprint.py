"""The identity of a model and a cache setting, for pages kept on disk (``engine.kv.tier.disk``).

A page file is reused only by the same weights, architecture, dtype, RoPE settings, page size and K/V precision:
its folder is named by ``shelf_fingerprint``. The weights are identified by their bytes as loaded, not by file
names: every parameter and buffer (RoPE's ``inv_freq`` included) contributes its name, shape, dtype and a sample
of its values — whole tensors up to 64K elements, else 4,096 evenly spaced ones plus the first and last 256. A
fine-tune changes nearly every value of the matrices it touches, so two fine-tunes of one base never share a
fingerprint; hashing the samples of a 135M-parameter model takes ~10 ms, where hashing all its 540 MB would take
~0.5 s at every load. The config (RoPE theta and scaling included), the device type and torch's version are
hashed too: K/V computed on another device or torch build may differ in the last bits.
"""

from __future__ import annotations

import hashlib
import json

import torch

WHOLE = 1 << 16  # tensors up to this many elements are hashed whole
SAMPLES = 4096  # elements sampled (evenly spaced) from larger ones
ENDS = 256  # plus their first and last elements
VOLATILE = ("_name_or_path", "transformers_version", "_commit_hash")  # config keys that do not change K/V


def _tensor_bytes(t: torch.Tensor) -> bytes:
    if t.is_mkldnn:  # a linear's weight packed for oneDNN (``engine.model.prepack``): its values in plain layout
        t = t.to_dense()
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n > WHOLE:
        flat = torch.cat([flat[:ENDS], flat[::n // SAMPLES][:SAMPLES], flat[-ENDS:]])
    flat = flat.to("cpu").contiguous()
    return flat.view(torch.uint8).numpy().tobytes() if flat.element_size() else b""


def _config_json(model) -> str:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return ""
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    for key in VOLATILE:
        d.pop(key, None)
    d["_attn_implementation"] = getattr(cfg, "_attn_implementation", None)
    return json.dumps(d, sort_keys=True, default=str)


def model_fingerprint(lm) -> str:
    """Hex digest of ``lm``'s weights as loaded, config, K/V dtype, device type and torch version."""
    h = hashlib.sha256(b"kvscope-model-v1\0")
    model = lm.model
    h.update(_config_json(model).encode())
    h.update(f"\0{lm.kv_dtype}\0{lm.device.type}\0{torch.__version__}\0".encode())
    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in sorted(named, key=lambda x: x[0]):
        h.update(f"{name}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def shelf_fingerprint(model_fp: str, arena) -> str:
    """The folder name of one arena's pages: the model's fingerprint, page size, K/V precision and K/V shape."""
    s = arena.shape
    key = (f"{model_fp}\0{arena.page_size}\0{arena.kinds['k']}\0{arena.kinds['v']}\0{s.num_layers}\0{s.of('k')}\0"
           f"{s.of('v')}\0{s.dtype}")
    return hashlib.sha256(key.encode()).hexdigest()[:32]
