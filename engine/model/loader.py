"""Load a model and tokenizer: a local Hugging Face folder, a model in the HF cache, a hub id, the shipped
``stories260K`` (``engine.model.builtin``) or ``demo``.

Safety: safetensors only unless pickle is allowed; remote code refused unless allowed. Every refusal or
failure is a typed ``EngineError`` with a one-line reason.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from engine.model.builtin import builtin_model_dir, is_builtin
from engine.model.gguf_file import looks_like_gguf
from engine.config import ModelSpec
from engine.errors import (
    EngineError,
    LoadCancelled,
    ModelFormatError,
    ModelNotFoundError,
    OfflineError,
    UnsupportedModelError,
    first_line,
)
from engine.model.model_files import (  # noqa: F401  (check_safetensors, check_folder: public from here too)
    check_folder,
    check_loading_info,
    check_safetensors,
    check_shapes,
    check_tokenizer_fits,
)
from engine.model.hf_load import choose_dtype as _choose_dtype
from engine.model.hf_load import fix_bnb_4bit_cpu as _fix_bnb_4bit_cpu
from engine.model.hf_load import quiet_transformers
from engine.model.hf_load import weights_progress as _weights_progress
from engine.model import fit_check, weights_read
from engine.model import threads as cpu_threads
from engine.model.weights_held import held_info
from engine.model import template_guard
from engine.model.loaded import LoadedModel, wrap_model
from engine.model.weight_index import check_index

Progress = Callable[[str, float], None]  # (message, fraction 0..1 or -1 when unknown)

_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja", "*.tiktoken"]


# -- device ----------------------------------------------------------------------------------------------
def choose_device(requested: str) -> tuple[str, str]:
    """Resolve ``auto|cpu|cuda|mps`` to a device and the reason, in words, for the status bar."""
    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
    if requested == "cuda":
        if not cuda:
            raise EngineError("device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
        return "cuda", f"CUDA: {torch.cuda.get_device_name(0)} (chosen)"
    if requested == "mps":
        if not mps:
            raise EngineError("device mps: Apple Metal (MPS) is not available on this machine")
        return "mps", "MPS: Apple GPU (chosen)"
    if requested == "cpu":
        return "cpu", "CPU: chosen"
    if cuda:
        return "cuda", f"CUDA: {torch.cuda.get_device_name(0)}"
    if mps:
        return "mps", "MPS: Apple GPU (no CUDA device)"
    return "cpu", no_gpu_reason()


def no_gpu_reason() -> str:
    """Why the CPU runs the model, in words: a CUDA build of torch without the NVIDIA driver (its
    ``libcuda.so.1`` / ``nvcuda.dll`` belongs to the driver and is never bundled), a driver without a usable GPU,
    or a CPU-only torch on a machine with an NVIDIA driver."""
    import ctypes
    import sys

    cuda = torch.version.cuda
    if cuda:
        lib = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        try:
            ctypes.CDLL(lib)
        except OSError:
            return f"CPU: no NVIDIA driver found ({lib} is missing; this build uses CUDA {cuda})"
        return (f"CPU: the NVIDIA driver offers no usable GPU (no GPU, or a driver older than CUDA {cuda} needs: "
                "update it)")
    if os.path.exists("/proc/driver/nvidia/version"):
        return "CPU: an NVIDIA driver is installed but this torch is a CPU-only build (install the CUDA build)"
    return "CPU: no CUDA or MPS device"


# -- resolving a source to a folder -------------------------------------------------------------------------
def looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~")) and "\\" not in source


def resolve_source(spec: ModelSpec, progress: Progress | None = None) -> Path:
    """A local folder for ``spec.source``: the folder itself, the HF cache snapshot, or a fresh download."""
    src = os.path.expanduser(spec.source)
    path = Path(src)
    if is_builtin(spec.source) and not path.exists():  # a local folder of that name wins
        return builtin_model_dir()
    if path.exists():
        if not path.is_dir():
            raise ModelFormatError(f"{src} is a file: choose the model's folder (with config.json)")
        return path
    if not looks_like_hub_id(spec.source):
        raise ModelNotFoundError(f"model folder not found: {src}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec.source, local_files_only=True, allow_patterns=_DOWNLOAD_PATTERNS))
    except Exception:
        pass
    if not spec.allow_download or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise OfflineError(f"{spec.source} is not in the local Hugging Face cache and downloads are off")
    if progress:
        progress(f"downloading {spec.source}", -1.0)
    try:
        return Path(snapshot_download(spec.source, allow_patterns=_DOWNLOAD_PATTERNS, etag_timeout=10))
    except Exception as e:  # network errors come in many types; all mean the same to the user
        name = type(e).__name__
        if "RepositoryNotFound" in name or "GatedRepo" in name:
            raise ModelNotFoundError(f"{spec.source}: no such model on the hub (or it is gated)") from None
        raise OfflineError(
            f"cannot download {spec.source}: the Hugging Face hub is unreachable ({name}); "
            "open a local folder or the demo model"
        ) from None


# -- loading ----------------------------------------------------------------------------------------------
def load_model(spec: ModelSpec | str, progress: Progress | None = None,
               cancel: threading.Event | None = None) -> LoadedModel:
    """Load ``spec`` (a ``ModelSpec`` or a source string). Raises ``EngineError`` subclasses.

    ``progress(message, fraction)`` is called at each stage and while the weights load (per tensor);
    setting ``cancel`` (from any thread) stops the load at the next stage or tensor with ``LoadCancelled``,
    and what was loaded so far is released.
    """
    if isinstance(spec, str):
        spec = ModelSpec(source=spec)

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise LoadCancelled(f"loading {spec.source} was cancelled")

    check()
    since = cpu_threads.sample()  # other programs' CPU work is measured from here to the threads' choice
    device, reason = choose_device(spec.device)
    if spec.source == "demo":
        from engine.model.demo import build_demo

        if progress:
            progress("building the demo model", 0.5)
        model, tok = build_demo()
        model.to(device)
        return wrap_model(model, tok, spec, device, reason, name="demo (random weights)", path=None, is_demo=True)

    if looks_like_gguf(os.path.expanduser(spec.source)):  # a llama.cpp file: engine.model.gguf_load
        from engine.model.gguf_load import load_gguf

        # refused before any weight; said by the GGUF loader once the file passed its own checks
        verdict = fit_check.check(Path(os.path.expanduser(spec.source)), spec, device, progress, say=False)
        model, tok, path, name = load_gguf(spec, device, progress, check,
                                           fit_check.note(verdict) if verdict is not None else None)
    else:
        path = resolve_source(spec, progress)
        model, tok, verdict = _load_folder(path, spec, device, progress, check)
        name = path.name
    check()
    if progress:
        progress(f"moving {name} to {device}", 0.97)
    if spec.quantization == "none":
        model.to(device)
    if spec.quantization == "nf4" and device == "cpu":
        _fix_bnb_4bit_cpu(model)
    if spec.quantization != "none" and device == "cpu" and not getattr(model, "kvscope_block_plan", None):
        from engine.quant.gguf_keep import block_plan

        # int8 / NF4 held as block linears (Q8_0, NF4 blocks): a compiled step's child builds the same modules
        model.kvscope_block_plan = block_plan(model) or None
    model.eval()
    from engine.quant.modules import pack_soon, shapes_only

    with shapes_only():  # its three-token test run asks the shapes: a GGUF's blocks are read at the first reply
        lm = wrap_model(model, tok, spec, device, reason, name=name, path=str(path), is_demo=False, since=since)
    # a GGUF's repacking and the pages of its weights multiplied in place, off the load's path
    pack_soon(model.__dict__.pop("kvscope_pack_group", None) or [], model.__dict__.pop("kvscope_map_pages", None))
    if verdict is not None:
        lm.info = held_info(lm.info, verdict.weights, model)
    if lm.info.unsupported:
        raise UnsupportedModelError(f"{name}: {lm.info.unsupported}")
    if progress and str(device) == "cpu":  # no compiler and nothing prebuilt: which fast paths are missing, once
        from engine.model.linear_op import say_missing
        say_missing(progress)
    return lm


def _load_folder(folder: Path, spec: ModelSpec, device: str, progress: Progress | None, check: Callable[[], None]):
    """(model, tokenizer) of a Hugging Face folder, every file checked before transformers reads it."""
    cfg = check_folder(folder, spec)
    if progress:
        progress(f"loading {folder.name}", 0.1)
    quiet_transformers()
    config = _load_config(folder, cfg, spec)
    check_index(folder.name, config, folder)  # sizes, pickle files, layer count: before anything is built
    tok = _load_tokenizer(folder, spec)
    template_guard.trial(tok, folder.name)
    check()
    _check_against_model(folder, config, tok, spec)
    verdict = fit_check.check(folder, spec, device, progress)  # WontFitError before a weight is read
    return _load_weights(folder, config, spec, device, progress, check), tok, verdict


def _load_config(folder: Path, cfg: dict, spec: ModelSpec):
    """transformers' config of a causal LM this engine can run; typed errors otherwise."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=spec.trust_remote_code)
    except ValueError as e:
        raise UnsupportedModelError(f"unsupported model type {cfg.get('model_type')!r}: {first_line(e)}") from None
    except Exception as e:
        raise ModelFormatError(f"cannot read the config in {folder}: {first_line(e)}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not spec.trust_remote_code:
        raise UnsupportedModelError(
            f"{folder.name}: model type {config.model_type!r} is not a text-generation (causal LM) architecture"
        )
    return config


def _load_tokenizer(folder: Path, spec: ModelSpec):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=spec.trust_remote_code)
    except Exception as e:
        raise ModelFormatError(f"no usable tokenizer in {folder}: {str(e).splitlines()[0][:200]}") from None
    if tok is None or not hasattr(tok, "decode"):
        raise ModelFormatError(f"no usable tokenizer in {folder}")
    return tok


def _load_weights(folder: Path, config, spec: ModelSpec, device: str, progress: Progress | None,
                  check: Callable[[], None]):
    """The model with its weights (per-tensor progress and cancel), refused unless they cover it."""
    from safetensors import SafetensorError

    dtype = _choose_dtype(spec, config, device)
    mapped = _mapped(folder, config, spec, dtype, device, progress, check)
    if mapped is not None:
        return mapped
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        attn_implementation="sdpa",
        trust_remote_code=spec.trust_remote_code,
        use_safetensors=None if spec.allow_pickle else True,
        output_loading_info=True,  # missing / unexpected / mis-shaped weights, checked below
        ignore_mismatched_sizes=True,  # so a wrong shape is reported there, by name, not raised as prose
    )
    kwargs.update(weights_read.placement(spec, dtype, device))  # quantization, device_map
    read = weights_read.reader(folder, config, kwargs, spec.trust_remote_code)
    try:
        with _weights_progress(folder.name, progress, check):
            try:
                model, loading_info = read()
            except ValueError as e:
                if "sdpa" not in str(e).lower() and "scaled_dot_product" not in str(e).lower():
                    raise
                kwargs["attn_implementation"] = "eager"  # transformers has no sdpa for this class (softcap, sinks)
                model, loading_info = read()
    except LoadCancelled:
        raise
    except torch.OutOfMemoryError:
        raise EngineError(f"out of memory loading {folder.name} on {device}: try 8-bit/4-bit or the CPU") from None
    except ImportError as e:
        raise EngineError(f"missing package for {folder.name}: {str(e).splitlines()[0]}") from None
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise ModelFormatError(f"cannot load the weights of {folder.name}: {str(e).splitlines()[0][:300]}") from None
    _check_coverage(folder.name, model, loading_info)
    return model


def _mapped(folder: Path, config, spec: ModelSpec, dtype: torch.dtype, device: str, progress: Progress | None,
            check: Callable[[], None]):
    """The model with its bf16 weights multiplied from the files' mappings (``engine.model.folder_keep``), or None
    where that does not apply (the folder is read as before)."""
    from engine.model import folder_keep

    if not folder_keep.applies(folder, config.model_type, spec, str(dtype).removeprefix("torch."), device):
        return None
    try:
        return folder_keep.load(folder, config, dtype, progress, check,
                                quantize=spec.quantization if spec.quantization in ("int8", "nf4") else "")
    except LoadCancelled:
        raise
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelFormatError(f"cannot load the weights of {folder.name}: {first_line(e)}") from None


def _check_against_model(folder: Path, config, tok, spec: ModelSpec) -> None:
    """Before any weight is read: the files' tensor shapes and the tokenizer's ids against the model this
    config builds, on the meta device (no memory, milliseconds even for billions of parameters)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=spec.trust_remote_code)
        rows = getattr(skeleton.get_input_embeddings(), "num_embeddings", None)
    except Exception:  # some models cannot be built on meta; the checks after loading still apply
        return
    check_shapes(folder.name, {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}, folder)
    check_tokenizer_fits(folder.name, tok, rows)


def _check_coverage(name: str, model, loading_info: dict) -> None:
    """Refuse weights that leave part of the model at its random initialisation (or carry extra tensors)."""
    names = {n for n, _ in model.named_parameters()}  # a tied tensor once, under its first name
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - names
    check_loading_info(name, loading_info, names, tied)
