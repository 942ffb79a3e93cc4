"""A Hugging Face folder's weights read tensor by tensor, each into memory of its own, so that a load holds the
weights it keeps and one tensor in flight — never the file's pages beside them.

Why: transformers memory-maps each ``.safetensors`` file (a private mapping) and hands out tensors that point into
it; every page a conversion or a quantizer reads stays in the process (resident, counted in its RSS) until the
whole file is closed at the end of the load. Measured on the Llama-3.2-1B shape (bf16 folder, 1.95 GB; AMD EPYC,
one thread, 2026-12-06): ``--quantize int8`` peaked at 3,486 MB for 932 MB of int8 weights, ``nf4`` at 3,415 MB
for 526 MB, ``--dtype bfloat16`` at 4,169 MB (the file's pages plus the packed copies of the linears), float32 at
5,922 MB. Read with ``pread`` (safetensors' own ``backend="pread"``, which transformers uses on Windows and Apple
GPUs), a tensor's bytes live in a buffer that is freed once it is converted, quantized or packed; with the heap's
loading rules (``engine.model.heap.while_loading``) the freed buffers go back to the system: 1,528 / 1,141 /
2,286 / 4,203 MB.

The folder is handed to transformers as a state dict of those lazy slices (its public ``state_dict`` argument):
its own renaming, dtype, quantization and tied-weight logic all still apply. Remote-code models and pickle
checkpoints keep transformers' own reading.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model.model_files import weight_files


def readable(folder: Path, trust_remote_code: bool) -> bool:
    """Can this folder's weights be read here (safetensors files, a model class transformers knows by config)?"""
    return not trust_remote_code and bool(weight_files(folder))


def lazy_state(folder: Path) -> tuple[dict[str, Any], list[Any]]:
    """Every tensor of the folder's safetensors files as a slice that reads its bytes when sliced (``pread``), and
    the open files (closed by ``close``). The files were checked before (``model_files.check_folder``)."""
    from safetensors import safe_open

    state: dict[str, Any] = {}
    handles = []
    try:
        for path in weight_files(folder):
            f = safe_open(str(path), framework="pt", device="cpu", backend="pread")
            handles.append(f)
            for name in f.keys():
                state[name] = f.get_slice(name)
    except BaseException:
        close(handles)
        raise
    return state, handles


def close(handles: list[Any]) -> None:
    for f in handles:
        try:
            f.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - closing a file that failed to open fully
            pass


def causal_lm_class(config):
    """The transformers class ``AutoModelForCausalLM`` builds for ``config`` (a state dict is loaded through the
    concrete class: the auto class wants a path); of several, the one ``config.architectures`` names."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if isinstance(cls, (list, tuple)):
        named = set(getattr(config, "architectures", None) or ())
        cls = next((c for c in cls if c.__name__ in named), cls[0])
    return cls


def from_folder(folder: Path, config, kwargs: dict[str, Any]):
    """``(model, loading_info)`` as ``AutoModelForCausalLM.from_pretrained(folder, **kwargs)`` returns them, the
    weights read tensor by tensor (module doc). ``kwargs`` carries ``output_loading_info=True``."""
    from engine.model import heap

    cls = causal_lm_class(config)
    kw = {k: v for k, v in kwargs.items() if k not in ("use_safetensors", "trust_remote_code")}
    kw["generation_config"] = generation_config(folder)
    state, handles = lazy_state(folder)
    try:
        with heap.while_loading():
            return cls.from_pretrained(None, config=config, state_dict=state, **kw)
    finally:
        close(handles)
        state.clear()


def generation_config(folder: Path):
    """What ``from_pretrained`` reads beside the weights from a path, as it reads it: generation_config.json, else
    the generation settings of config.json."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(folder))
    except OSError:
        return GenerationConfig.from_pretrained(str(folder), config_file_name="config.json", _from_model_config=True)


def placement(spec, dtype, device: str) -> dict[str, Any]:
    """``from_pretrained``'s quantization and placement for ``spec``: int8 on a CPU as Q8_0 blocks
    (``engine.model.q8_load``), else bitsandbytes (its 4-bit quantization in C on a CPU: ``engine.model.nf4_quant``);
    every tensor to the device as it is read (never the whole model in RAM first)."""
    from engine.model import nf4_quant, q8_load
    from engine.model.hf_load import bnb_config

    out: dict[str, Any] = {}
    if spec.quantization == "int8" and q8_load.available(device):
        out["quantization_config"] = q8_load.config()  # Q8_0 blocks for the GGUF kernels, quantized as read
    elif spec.quantization != "none":
        out["quantization_config"] = bnb_config(spec.quantization, dtype)
        if spec.quantization == "nf4" and device == "cpu":
            nf4_quant.install()  # bitsandbytes' 4-bit quantization in C: the same blocks, 25x faster
    if spec.quantization != "none" or device != "cpu":
        out["device_map"] = {"": device}
    return out


def reader(folder: Path, config, kwargs: dict[str, Any], trust_remote_code: bool):
    """The call that reads the folder's weights with ``kwargs`` (``(model, loading_info)``): tensor by tensor
    (``from_folder``) where it can, else transformers' own reading (remote code, pickle checkpoints)."""
    if readable(folder, trust_remote_code):
        return lambda: from_folder(folder, config, kwargs)
    from transformers import AutoModelForCausalLM

    return lambda: AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
