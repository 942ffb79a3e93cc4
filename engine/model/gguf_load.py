"""Loading a GGUF file through transformers' GGUF support (``from_pretrained(dir, gguf_file=...)``) into the same
engine as a folder's model: paged cache, every policy and panel, the tokenizer and chat template the file carries.

Order ("can I?" before "do it"): ``engine.model.gguf_file.read_gguf`` refuses a bad file in one line before
transformers opens it; the architecture is checked against what transformers can read from GGUF; the memory the
weights will take is said (``progress``) before they are read. The weights of the architectures
``engine.quant.formats.ARCHITECTURES`` lists stay as the file stores them, mapped from it, and are multiplied by the
GGUF block kernels (``engine.quant``); other architectures, and machines without the kernels, get them dequantized
to the compute dtype (float32 on a CPU), as transformers' GGUF loader does; ``--quantize int8|nf4`` then
re-quantizes the dequantized weights with bitsandbytes (transformers refuses a ``quantization_config`` next to
``gguf_file``, so that path hands it the state dict).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch

from engine.config import ModelSpec
from engine.errors import EngineError, LoadCancelled, ModelFormatError, UnsupportedModelError, first_line
from engine.model import template_guard
from engine.model.gguf_checks import NOT_GENERATIVE, check_model, check_named
from engine.model.gguf_fields import from_header
from engine.model.gguf_file import GgufInfo, read_gguf, string_starts
from engine.model.hf_load import LoadNote, Progress, bnb_config, choose_dtype, quiet_transformers, weights_progress
from engine.model.model_files import check_loading_info, check_tokenizer_fits
from engine.model.packed_linear import gguf_float_layout
from engine.quant import gguf_keep

# llama.cpp's spelling of an architecture → transformers' model type, where they differ
_SPELLINGS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
def readable_architectures() -> tuple[str, ...]:
    """The GGUF architectures (``general.architecture``, llama.cpp's spelling) transformers can read into a
    text-generation model: its legacy table (dequantized through the gguf package) and its newer per-architecture
    mappings."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        from transformers.integrations.gguf import GGUF_ARCHS
    except ImportError:  # an older transformers: the legacy table only
        GGUF_ARCHS = {}
    back = {v: k for k, v in _SPELLINGS.items()}
    names = {back.get(a, a) for a in (*GGUF_SUPPORTED_ARCHITECTURES, *GGUF_ARCHS)}
    return tuple(sorted(n for n in names if n not in NOT_GENERATIVE))


def check_architecture(info: GgufInfo) -> None:
    """Refuse a file whose architecture transformers cannot read from GGUF, naming those it can."""
    check_named(info)
    name, arch = Path(info.path).name, info.architecture
    readable = readable_architectures()
    if arch not in readable:
        raise UnsupportedModelError(
            f"{name}: transformers cannot read architecture {arch!r} from GGUF; it reads {', '.join(readable)} "
            "(or open the model's Hugging Face folder)")


def _legacy(info: GgufInfo) -> bool:
    """True when transformers reads this architecture with its legacy loader (dequantizing every tensor through
    the gguf package), the path a bitsandbytes re-quantization can take."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return _SPELLINGS.get(info.architecture, info.architecture) in GGUF_SUPPORTED_ARCHITECTURES


def load_gguf(spec: ModelSpec, device: str, progress: Progress | None,
              check: Callable[[], None], memory_note: LoadNote | None = None) -> tuple[Any, Any, Path, str]:
    """(model, tokenizer, path, name) of the GGUF file ``spec.source``; every refusal an ``EngineError`` with one
    line. ``name`` is the file's name, or for a file without the .gguf suffix (an Ollama blob, ``sha256-<hex>``)
    the model's own ``general.name``."""
    info = read_gguf(spec.source)
    check_architecture(info)
    check_model(info)  # the header's sizes against its tensors, before transformers builds anything from them
    path = Path(info.path)
    if spec.quantization in ("int8", "nf4") and not _legacy(info):
        raise UnsupportedModelError(f"{path.name}: 8-bit/4-bit re-quantization of a {info.architecture} GGUF is not "
                                    "available; load it without --quantize")
    quiet_transformers()
    with from_header(info):  # transformers reads the settings from the header parsed above, the vocabulary once
        config, tok = _config(path), _tokenizer(path)
    dtype = choose_dtype(spec, config, device)
    template_guard.trial(tok, path.name)  # a template past its bounds refused before a weight is read
    keep = spec.quantization not in ("int8", "nf4") and not gguf_keep.refusal(info.architecture, device)
    elem = torch.empty((), dtype=dtype).element_size()
    note = (kept_note(info, gguf_keep.plan(info, device, elem, gguf_float_layout(dtype, device))) if keep
            else load_note(info, str(dtype).removeprefix("torch."), elem, spec.quantization))
    if progress:
        if memory_note is not None:  # the memory verdict (engine.model.fit_check), once the file passed its checks
            progress(memory_note, 0.1)
        progress(LoadNote(note), 0.1)
    check()
    model = _kept(path, info, config, dtype, device, progress, check) if keep else \
        _weights(path, config, spec, dtype, device, progress, check)
    tokens = info.metadata.get("tokenizer.ggml.tokens")  # (check_model: present, no more of them than rows)
    check_tokenizer_fits(path.name, tok, getattr(model.get_input_embeddings(), "num_embeddings", None),
                         tokens["count"] if isinstance(tokens, dict) else len(tokens))
    return model, tok, path, path.name if path.name.lower().endswith(".gguf") else info.name


def _kept(path: Path, info: GgufInfo, config, dtype: torch.dtype, device: str, progress: Progress | None,
          check: Callable[[], None]):
    """The model with the file's weights kept as blocks, mapped from it (``engine.quant.gguf_keep``)."""
    try:
        # where the header's string arrays end, while the file is the version its walk read ({} else: an offset
        # into a file rewritten since the memory verdict never reads the new one's bytes; the table walks them)
        ends = {at: end for at, (_, end) in string_starts(info).items()}
        model = gguf_keep.load(path, info, config, dtype, device, progress, check, gguf_float_layout(dtype, device),
                               ends)
    except LoadCancelled:
        raise
    except KeyError:
        raise UnsupportedModelError(f"{path.name}: {config.model_type} is not a text-generation model") from None
    except torch.OutOfMemoryError:
        raise EngineError(f"out of memory loading {path.name} on {device}") from None
    except (OSError, ValueError, RuntimeError, IndexError) as e:
        raise ModelFormatError(f"cannot load the weights of {path.name}: {first_line(e)}") from None
    p = gguf_keep.plan(info, device, torch.empty((), dtype=dtype).element_size(), gguf_float_layout(dtype, device))
    # the kernel's line on the model card: the bits per weight are the weights row's (as held, one number there)
    model.kvscope_blocks = f"GGUF {info.weights_type}, {p.where} ({p.road})"
    return model


def kept_note(info: GgufInfo, p) -> str:
    """What loading ``info`` with its blocks kept holds (``gguf_keep.Plan``), said before the weights are read, e.g.
    'm-q4_k_m.gguf: Q4_K_M weights (558.1 MiB on disk, 4.81 bits per weight) stay as the file stores them, mapped
    from the file: 558.3 MiB of weights in memory (int8 activations, AVX-512 + VNNI)'."""
    from engine.quant import formats

    note = (f"{Path(info.path).name}: {info.weights_type} weights ({human_bytes(info.size_bytes)} on disk, "
            f"{p.bits:.2f} bits per weight) stay as the file stores them, {p.where}: "
            f"{human_bytes(p.mapped + p.copied)} of weights in memory ({p.road})")
    if p.lost:
        note += f"; {', '.join(p.lost)} weights have no block kernel and are dequantized (kept: {formats.kept_names()})"
    return note


def _config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=str(path))
    except Exception as e:  # noqa: BLE001 - transformers' reader raises many kinds; all mean one thing here
        raise ModelFormatError(f"cannot read the model's settings from {path.name}: {first_line(e)}") from None


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelFormatError(f"no usable tokenizer in {path.name}: {first_line(e)}") from None
    if tok is None or not hasattr(tok, "decode"):
        raise ModelFormatError(f"no usable tokenizer in {path.name}")
    return tok


@contextlib.contextmanager
def _legacy_loader(name: str, progress: Progress | None, check: Callable[[], None]):
    """While transformers' legacy GGUF loader runs (loads run one at a time, on the engine's loading thread):

    - progress per tensor (0.15..0.55) and cancel before each one, through the module's own ``tqdm`` (its
      dequantizing loop does not use transformers' progress hook);
    - one tensor-name map per load: it builds ``gguf.get_tensor_name_map(arch, layers)`` again for each of the
      model's submodules (397 for a 30-layer Llama, ~85 ms each: 34 of a 37 s load of SmolLM2-135M's shape here);
      the map is read-only, so a cache gives the same names."""
    import functools

    import gguf
    import transformers.modeling_gguf_pytorch_utils as legacy

    original_tqdm, original_map = getattr(legacy, "tqdm", None), gguf.get_tensor_name_map

    def tensors(items, *args, **kwargs):
        total = max(len(items), 1)
        every = max(1, total // 50)
        for i, item in enumerate(items):
            check()
            if progress and i % every == 0:
                progress(f"dequantizing {name}: tensor {i + 1} of {total}", 0.15 + 0.4 * i / total)
            yield item

    legacy.tqdm = tensors
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(original_map)
    try:
        yield
    finally:
        legacy.tqdm, gguf.get_tensor_name_map = original_tqdm, original_map


def _weights(path: Path, config, spec: ModelSpec, dtype: torch.dtype, device: str, progress: Progress | None,
             check: Callable[[], None]):
    """The model with the file's weights (dequantized, then re-quantized with bitsandbytes if asked), refused
    unless they cover it."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise UnsupportedModelError(f"{path.name}: {config.model_type} is not a text-generation model") from None
    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation="sdpa", output_loading_info=True)
    try:
        with _legacy_loader(path.name, progress, check), weights_progress(path.name, progress, check):
            try:
                model, info = _from_pretrained(cls, path, config, spec, dtype, device, kwargs)
            except ValueError as e:
                if "sdpa" not in str(e).lower() and "scaled_dot_product" not in str(e).lower():
                    raise
                kwargs["attn_implementation"] = "eager"  # no sdpa for this class (Gemma 2's softcapping)
                model, info = _from_pretrained(cls, path, config, spec, dtype, device, kwargs)
    except LoadCancelled:
        raise
    except torch.OutOfMemoryError:
        raise EngineError(f"out of memory loading {path.name} on {device}: try 8-bit/4-bit or the CPU") from None
    except ImportError as e:
        raise EngineError(f"missing package for {path.name}: {first_line(e)}") from None
    except (OSError, ValueError, RuntimeError, KeyError, IndexError) as e:
        raise ModelFormatError(f"cannot load the weights of {path.name}: {first_line(e)}") from None
    names = {n for n, _ in model.named_parameters()}
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - names
    check_loading_info(path.name, info, names, tied)
    return model


def _from_pretrained(cls, path: Path, config, spec: ModelSpec, dtype: torch.dtype, device: str, kwargs: dict):
    if spec.quantization not in ("int8", "nf4"):
        from transformers import GgufConfig

        # dequantize: a dense model the engine's paths and bitsandbytes know, not transformers' packed GGUF layers
        return cls.from_pretrained(str(path.parent), gguf_file=str(path), config=config,
                                   quantization_config=GgufConfig(dequantize=True), **kwargs)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = cls(config)  # names only: which GGUF tensor is which parameter
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype)["tensors"]
    return cls.from_pretrained(None, config=config, state_dict=state, device_map={"": device},
                               quantization_config=bnb_config(spec.quantization, dtype), **kwargs)


def human_bytes(n: float) -> str:
    """1,536 → '1.5 KiB' (the engine's one-line notes; the app has its own formatter)."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# bytes a parameter takes once loaded: bitsandbytes 8-bit ~1, NF4 ~0.56 (codes + per-block scales)
_REQUANT = {"int8": 1.0, "nf4": 0.56}


def load_note(info: GgufInfo, dtype: str, elem_bytes: int, quantization: str = "none") -> str:
    """What loading ``info`` does to its weights and the memory they take, said before they are read, e.g.
    'qwen2.5-0.5b-q8_0.gguf: Q8_0 weights (531.1 MiB on disk) are dequantized to float32 on load: 1.8 GiB of
    weights in memory'."""
    name = Path(info.path).name
    dense = info.n_params * elem_bytes
    verb = "are dequantized to" if info.quantized else "are loaded as"
    if quantization in _REQUANT:
        # bitsandbytes leaves the embeddings (and an untied output head) in the compute dtype
        cfg = info.config()
        embed = min(cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg["tie_word_embeddings"] else 2), info.n_params)
        held = embed * elem_bytes + (info.n_params - embed) * _REQUANT[quantization]
        kind = "8-bit" if quantization == "int8" else "NF4"
        return (f"{name}: {info.weights_type} weights ({human_bytes(info.size_bytes)} on disk) {verb} {dtype}, then "
                f"quantized to {kind} by bitsandbytes: ~{human_bytes(held)} of weights in memory "
                f"(~{human_bytes(dense)} while loading)")
    return (f"{name}: {info.weights_type} weights ({human_bytes(info.size_bytes)} on disk) {verb} {dtype} on load: "
            f"{human_bytes(dense)} of weights in memory")
