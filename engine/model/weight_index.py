"""The config against itself and the weights' own index, before any model is built.

transformers builds the whole model from ``config.json`` before it reads a weight: a config that says
2,000 layers over files that hold 5 allocated 0.8 GB and ran 16 s before "17,955 weights missing"; at
200,000 layers even the meta-device skeleton used for the shape checks never finished. A zero head count
raised ZeroDivisionError inside the model's constructor, and a corrupt pickle file an UnpicklingError (or
IndexError) from deep in torch. The tensor names in the safetensors headers (or a pickle checkpoint's own
index, unpickled onto the meta device) are read in milliseconds, so all of that is checked here, first.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.errors import ModelFormatError
from engine.model.model_files import PICKLE_WEIGHTS, read_header, weight_files

_PICKLE_INDEX = "pytorch_model.bin.index.json"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # older: pickled magic number
# sizes that divide or allocate in the model's constructor: 0 or less is never a real model
_POSITIVE = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size",
             "head_dim")
_FIX = "use the config.json that came with these weights"


def check_index(name: str, config, folder: Path) -> None:
    """Everything about ``config`` and the weight files that needs no model: sizes that must be positive,
    the pickle files' own structure, and the layer count against the files (``ModelFormatError``)."""
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    check_config_sizes(name, text_cfg)
    check_layer_count(name, text_cfg, tensor_names(folder))


def check_config_sizes(name: str, cfg) -> None:
    """Refuse a head count, width, vocabulary or layer count of 0 or less, and query heads that the
    key/value heads do not divide (grouped-query attention repeats each K/V head a whole number of times)."""
    values = {}
    for field in _POSITIVE:
        try:
            v = getattr(cfg, field, None)
        except Exception:  # noqa: BLE001 - per-layer values: transformers raises for the global one
            continue
        if type(v) is int:
            if v <= 0:
                raise ModelFormatError(f"{name}: config.json has {field} {v}: it must be at least 1 ({_FIX})")
            values[field] = v
    q, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if q and kv and q % kv:
        raise ModelFormatError(f"{name}: config.json has num_attention_heads {q}, not a multiple of "
                               f"num_key_value_heads {kv} ({_FIX})")


def tensor_names(folder: Path) -> list[str] | None:
    """The weight names the files declare, without reading a tensor's data: the safetensors headers, else
    each pickle checkpoint unpickled onto the meta device (``weights_only``: no code runs). None when there
    is nothing transformers would read by name (``model.pt`` and the like)."""
    files = weight_files(folder)
    if files:
        names: list[str] = []
        for p in files:
            names.extend(read_header(p)[0])
        return names
    names = []
    for p in _pickle_files(folder):
        names.extend(_pickle_names(p))
    return names or None


def _pickle_files(folder: Path) -> list[Path]:
    """The pickle checkpoints transformers reads: those its index names, else ``pytorch_model.bin``."""
    index = folder / _PICKLE_INDEX
    if not index.exists():
        single = folder / PICKLE_WEIGHTS[0]
        return [single] if single.is_file() else []
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        data = None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ModelFormatError(f"{_PICKLE_INDEX} is corrupt: it has no weight_map object of file names "
                               "(re-download or re-export the model)")
    if not isinstance(data.get("metadata"), dict):  # transformers reads index["metadata"]: KeyError without
        raise ModelFormatError(f"{_PICKLE_INDEX} is corrupt: it has no metadata object (re-download or re-export "
                               "the model)")
    files = [folder / f for f in dict.fromkeys(wmap.values())]
    for f in files:
        if not f.is_file():
            raise ModelFormatError(f"{_PICKLE_INDEX} lists {f.name}, which is not a file in {folder} "
                                   "(re-download or re-export the model)")
    return files


def _pickle_names(path: Path) -> list[str]:
    """The keys of a ``torch.save``d state dict, its tensors placed on the meta device (the zip format is
    memory-mapped: only its small pickle is read). ``ModelFormatError`` for anything that is not one."""
    import torch

    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
    if not head.startswith(_ZIP_MAGIC) and head != _LEGACY_MAGIC:
        raise ModelFormatError(f"{path.name} is not a PyTorch checkpoint (neither torch.save's zip archive nor "
                               "its legacy format): re-download or re-export the model")
    try:
        sd = torch.load(path, map_location="meta", weights_only=True, mmap=head.startswith(_ZIP_MAGIC))
    except Exception as e:  # noqa: BLE001 - a corrupt pickle fails as UnpicklingError, EOFError, IndexError, ...
        first = str(e).splitlines()[0].split(". ")[0][:160] if str(e) else type(e).__name__  # torch's advice cut
        raise ModelFormatError(f"{path.name} is corrupt: torch cannot read it ({first}); re-download or "
                               "re-export the model") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) for k in sd):
        raise ModelFormatError(f"{path.name} is not a state dict (a mapping of weight names to tensors): "
                               "re-download or re-export the model")
    return list(sd)


def layer_stacks(names: list[str]) -> dict[str, int]:
    """Each numbered module list in ``names`` with how many entries it has (its highest index + 1):
    ``model.layers.4.mlp.up_proj.weight`` counts toward ``model.layers``. Only the first number in a name
    counts, so experts inside a layer (``...layers.3.mlp.experts.7...``) do not make a stack of their own."""
    stacks: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                prefix = ".".join(parts[:i])
                stacks[prefix] = max(stacks.get(prefix, 0), int(part) + 1)
                break
    return stacks


def check_layer_count(name: str, cfg, names: list[str] | None) -> None:
    """Refuse a config with more layers than any layer stack in the weight ``names`` (``ModelFormatError``).

    Only "more" is refused here: fewer layers than the files builds a small model fast and the loader's
    coverage check names the extra tensors; several stacks (a vision tower beside the text layers) pass when
    any of them is long enough; ``names`` None (nothing readable by name) is not checked."""
    layers = getattr(cfg, "num_hidden_layers", None)
    if type(layers) is not int or names is None:
        return
    stacks = layer_stacks(names)
    longest = max(stacks.items(), key=lambda kv: kv[1], default=None)
    if longest is not None and longest[1] >= layers:
        return
    held = f"{longest[1]} ({longest[0]}.0..{longest[1] - 1})" if longest else "no"
    raise ModelFormatError(
        f"{name}: config.json says num_hidden_layers {layers} but the weight files hold {held} layers: "
        "re-download the model, or use the config.json that came with these weights"
    )
