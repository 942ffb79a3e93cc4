"""Checks of a model folder's files before transformers reads them, and of the weights against the model.

transformers and safetensors report a malformed file with their own exception types (or, worse, load
it: missing weights are initialised randomly and the model prints garbage). Every check here raises
``ModelFormatError`` with a one-line reason that says what to do instead.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping

from engine.config import ModelSpec
from engine.errors import ModelFormatError, UnsafeModelError

PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
INDEX = "model.safetensors.index.json"
# files transformers opens by name: each must be a regular file if it is there at all
_NAMED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                "chat_template.jinja", INDEX)
# bytes per element of the dtypes safetensors can hand to torch (safetensors.torch._TYPES)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
                "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4,
                "U64": 8, "I64": 8, "F64": 8, "C64": 8}
_MAX_HEADER = 100_000_000  # safetensors' own limit
_FIX = "re-download or re-export the model"


def _corrupt(path: Path, detail: str) -> ModelFormatError:
    return ModelFormatError(f"{path.name} is corrupt: {detail} ({_FIX})")


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    return "null" if value is None else "an object"


def _is_uints(value: Any) -> bool:
    """A list of non-negative ints (bools are ints to Python but not to safetensors)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _not_a_file(path: Path) -> str | None:
    """None for a regular file (or a link to one); otherwise what it is, in words."""
    if path.is_file():
        return None
    if path.is_symlink() and not path.exists():
        return "a broken link"
    return "a directory" if path.is_dir() else "not a regular file"


def _require_file(path: Path) -> None:
    kind = _not_a_file(path)
    if kind:
        raise ModelFormatError(f"{path.name} is {kind} in {path.parent}: expected a file ({_FIX})")


# -- safetensors ------------------------------------------------------------------------------------------------
def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The tensor entries of a .safetensors header (``__metadata__`` removed) and the data size in bytes."""
    _require_file(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{path.name} is truncated ({size} bytes): not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > _MAX_HEADER:
                raise ModelFormatError(f"{path.name} is corrupt or truncated (header of {n} bytes in a {size}-byte file)")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _corrupt(path, "its safetensors header is not valid JSON") from None
    except OSError as e:
        raise ModelFormatError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, f"its safetensors header is {_json_kind(header)}, not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _corrupt(path, "its __metadata__ is not an object of strings")
    return header, size - 8 - n


def _entry_span(path: Path, name: str, meta: Any) -> tuple[int, int]:
    """Validate one tensor entry; its (start, end) byte offsets in the data."""
    if not isinstance(meta, dict):
        raise _corrupt(path, f"the entry of tensor {name!r} is not an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise _corrupt(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not _is_uints(shape):
        raise _corrupt(path, f"tensor {name!r} has invalid shape {shape!r} (expected a list of non-negative integers)")
    if not (_is_uints(offsets) and len(offsets) == 2):
        raise _corrupt(path, f"tensor {name!r} has invalid data_offsets {offsets!r} (expected two non-negative integers)")
    start, end = offsets
    if end < start:
        raise _corrupt(path, f"tensor {name!r} has data_offsets {offsets} with the end before the start")
    need = math.prod(shape) * _DTYPE_BYTES[dtype]
    if end - start != need:
        raise _corrupt(path, f"tensor {name!r} holds {end - start} bytes but its shape {shape} of {dtype} needs {need}")
    return start, end


def check_safetensors(path: Path) -> dict[str, Any]:
    """Validate a .safetensors file as safetensors itself would (every entry well formed, the tensors
    tiling the data exactly), so its errors never reach the user raw. Returns the tensor entries."""
    tensors, data_size = read_header(path)
    spans = sorted((_entry_span(path, name, meta), name) for name, meta in tensors.items())
    end = max((e for (_, e), _ in spans), default=0)
    if end > data_size:  # the usual cause: a download that stopped early
        raise ModelFormatError(
            f"{path.name} is truncated: {path.stat().st_size} bytes on disk, {path.stat().st_size - data_size + end} "
            "expected (re-download the model)"
        )
    pos, prev = 0, None
    for (start, stop), name in spans:
        if start < pos:
            raise _corrupt(path, f"tensors {prev!r} and {name!r} overlap (bytes {start}..{pos})")
        if start > pos:
            raise _corrupt(path, f"{start - pos} unused bytes before tensor {name!r}")
        pos, prev = stop, name
    if pos < data_size:
        raise _corrupt(path, f"{data_size - pos} bytes after the last tensor")
    return tensors


def weight_files(folder: Path) -> list[Path]:
    """The .safetensors files transformers will read: those the index names, else model.safetensors, else all."""
    index = folder / INDEX
    if index.exists():
        _require_file(index)
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise _corrupt(index, "it is not valid JSON") from None
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise _corrupt(index, "it has no weight_map object of file names")
        if not isinstance(data.get("metadata"), dict):  # transformers reads index["metadata"]: KeyError without
            raise _corrupt(index, "it has no metadata object")
        files = [folder / f for f in dict.fromkeys(wmap.values())]
        for f in files:
            if not os.path.lexists(f):
                raise ModelFormatError(f"{INDEX} lists {f.name}, which is not in {folder} ({_FIX})")
        return files
    single = folder / "model.safetensors"
    return [single] if os.path.lexists(single) else sorted(folder.glob("*.safetensors"))


# config.json fields transformers builds the model from: whole numbers (null where optional), and real numbers
_WHOLE_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
                 "vocab_size", "head_dim", "max_position_embeddings", "sliding_window", "n_layer", "n_head",
                 "n_embd", "n_positions", "num_layers", "num_heads", "n_ctx")
_REAL_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta")


def _value_words(v: Any) -> str:
    if isinstance(v, str):
        return f"a string ({v[:40]!r})"
    if isinstance(v, (list, dict)):
        return _json_kind(v)
    return repr(v)


def config_problem(cfg: Mapping[str, Any]) -> str:
    """What is wrong with the sizes in a parsed config.json (and its ``text_config``), in words ("" when
    nothing): a string, a list, a fraction or infinity where transformers needs a whole number, or a non-finite
    epsilon / rope base — transformers raises a multi-line validation error for them."""
    for part in (cfg, cfg.get("text_config")):
        if not isinstance(part, Mapping):
            continue
        for key in _WHOLE_FIELDS:
            v = part.get(key)
            if v is None:
                continue
            if type(v) is not int:  # a value below 1 is weight_index.check_config_sizes' to refuse
                return f"{key} is {_value_words(v)}, not a whole number"
        for key in _REAL_FIELDS:
            v = part.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return f"{key} is {_value_words(v)}, not a number"
            if not math.isfinite(v) or v <= 0:
                return f"{key} is {v}: it must be a finite number above 0"
    return ""


def check_folder(folder: Path, spec: ModelSpec) -> dict:
    """Reject what we cannot or must not load; returns the parsed config.json."""
    cfg_path = folder / "config.json"
    if not os.path.lexists(cfg_path):
        raise ModelFormatError(f"no config.json in {folder}: not a Hugging Face model folder")
    for name in _NAMED_FILES:
        if os.path.lexists(folder / name):
            _require_file(folder / name)
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ModelFormatError(f"{cfg_path} is not valid JSON") from None
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{cfg_path} is not a JSON object")
    problem = config_problem(cfg)
    if problem:
        raise ModelFormatError(f"{folder.name}: config.json's {problem} (use the config.json that came with these "
                               "weights)")
    if "auto_map" in cfg and not spec.trust_remote_code:
        raise UnsafeModelError(
            f"{folder.name} needs custom code from the model repository (auto_map in config.json); "
            "it can run anything on your machine: allow remote code only if you trust it (--trust-remote-code)"
        )
    safetensors = weight_files(folder)
    pickles = [folder / n for n in PICKLE_WEIGHTS if (folder / n).exists()] + sorted(folder.glob("pytorch_model-*.bin"))
    if safetensors:
        for p in safetensors:
            check_safetensors(p)
    elif pickles:
        if not spec.allow_pickle:
            raise UnsafeModelError(
                f"{folder.name} has only pickle weights ({pickles[0].name}); loading pickle can run code: "
                "allow it only if you trust the model (--allow-pickle)"
            )
    else:
        raise ModelFormatError(f"no weights in {folder} (expected *.safetensors)")
    return cfg


# -- the weights against the model ------------------------------------------------------------------------------
def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _few(keys: list[str], k: int = 3) -> str:
    return ", ".join(keys[:k]) + (f" and {len(keys) - k} more" if len(keys) > k else "")


def check_shapes(name: str, expected: Mapping[str, tuple[int, ...]], folder: Path) -> None:
    """Every tensor in the files that the model has by the same name must have the model's shape.

    transformers reports a wrong shape only when it loads in full precision; bitsandbytes quantizes the
    wrong tensor silently, so this runs before any load, against the model built on the meta device."""
    found: dict[str, list[int]] = {}
    for p in weight_files(folder):
        found.update({k: v["shape"] for k, v in read_header(p)[0].items()})
    bad = [f"{k} is {found[k]} in the files, the model needs {list(shape)}"
           for k, shape in expected.items() if k in found and list(shape) != found[k]]
    if bad:
        raise ModelFormatError(
            f"{name}: {_n(len(bad), 'weight')} with the wrong shape for its config.json ({_few(bad, 2)}): "
            "use the config.json that came with these weights"
        )


def check_loading_info(name: str, info: Mapping[str, Any], canonical: set[str], tied: set[str]) -> None:
    """Refuse weights that do not cover the model (transformers would initialise the rest randomly).

    ``canonical``: the model's parameter and persistent buffer names, each tied tensor once; ``tied``: the
    other names of tied tensors (such as lm_head tied to embed_tokens), never reported missing."""
    missing = sorted(k for k in info.get("missing_keys") or () if k not in tied)
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(f"{k} is {list(a)} in the files, the model needs {list(b)}"
                        for k, a, b, *_ in info.get("mismatched_keys") or ())
    if not (missing or unexpected or mismatched):
        return
    parts = [f"{_n(len(missing), 'weight')} missing ({_few(missing)})"] if missing else []
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({_few(unexpected)})")
    if mismatched:
        parts.append(f"{len(mismatched)} with the wrong shape ({_few(mismatched, 2)})")
    if canonical and set(missing) >= canonical:
        hint = "none of the model's weights are in the files: they were saved for another architecture or naming"
    else:
        hint = "re-download the model, or use the config.json that came with these weights"
    raise ModelFormatError(f"{name}: the weights do not match the model: {'; '.join(parts)}; {hint}")


def check_tokenizer_fits(name: str, tokenizer: Any, rows: int | None, dense: int | None = None) -> None:
    """Refuse a tokenizer that can produce ids the embedding has no row for: the first such token in a
    chat would crash the model mid-reply. ``dense``: the vocabulary's ids are ``0..dense - 1`` by construction (a
    GGUF's token array, positions as ids): only the added tokens are looked at (listing Llama-3's vocabulary for its
    largest id took 0.1 s of a 1.1 s load)."""
    if rows is None or not hasattr(tokenizer, "get_vocab"):
        return
    try:
        if dense is not None:
            top = max([dense - 1, *getattr(tokenizer, "added_tokens_decoder", {})])
        else:
            ids: Iterable[int] = tokenizer.get_vocab().values()
            top = max(ids, default=-1)
    except Exception:  # a tokenizer that cannot list its vocabulary: nothing to compare
        return
    if top >= rows:
        raise ModelFormatError(
            f"{name}: the tokenizer has token ids up to {top} but the model has {rows} embedding rows; "
            "use the tokenizer that came with these weights"
        )


def preflight(spec: ModelSpec) -> None:
    """A local model's files checked from their headers alone, before torch and transformers are imported (their
    import is 2-7 s of a command's start on a busy 2-core machine): a bad file's one line comes at once. The loader
    checks the same again (and more: transformers' readable architectures, the memory verdict)."""
    from engine.model.gguf_file import looks_like_gguf

    source = os.path.expanduser(spec.source)
    if looks_like_gguf(source):
        from engine.model.gguf_checks import check_model, check_named
        from engine.model.gguf_file import read_gguf

        info = read_gguf(source)
        check_named(info)
        check_model(info)
    elif os.path.isdir(source) and os.path.lexists(os.path.join(source, "config.json")):
        check_folder(Path(source), spec)
