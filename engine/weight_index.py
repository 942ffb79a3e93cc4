"""The config against the weights' own index, before any model is built.

transformers builds the whole model from ``config.json`` before it reads a weight: a config that says
2,000 layers over files that hold 5 allocated 0.8 GB and ran 16 s before "17,955 weights missing"; at
200,000 layers even the meta-device skeleton used for the shape checks never finished. The tensor names in
the safetensors headers (or a ``*.index.json`` weight map) are read in milliseconds, so the layer count is
compared here, first.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.errors import ModelFormatError
from engine.model_files import read_header, weight_files

_PICKLE_INDEX = "pytorch_model.bin.index.json"


def tensor_names(folder: Path) -> list[str] | None:
    """The weight names the files declare, without reading any tensor: the safetensors headers, else the
    pickle index's weight map. None when only an unindexed pickle file is there (its names need unpickling)."""
    files = weight_files(folder)
    if files:
        names: list[str] = []
        for p in files:
            names.extend(read_header(p)[0])
        return names
    index = folder / _PICKLE_INDEX
    if not index.is_file():
        return None
    try:
        wmap = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError):
        raise ModelFormatError(f"{_PICKLE_INDEX} is corrupt: it is not a JSON object with a weight_map "
                               "(re-download or re-export the model)") from None
    return list(wmap) if isinstance(wmap, dict) else None


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


def check_layer_count(name: str, config, folder: Path) -> None:
    """Refuse a config with more layers than any layer stack in the files (``ModelFormatError``).

    Only "more" is refused here: fewer layers than the files builds a small model fast and the loader's
    coverage check names the extra tensors; several stacks (a vision tower beside the text layers) pass when
    any of them is long enough, and folders whose names cannot be read without unpickling are not checked."""
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        layers = int(getattr(text_cfg, "num_hidden_layers", 0) or 0)
    except (TypeError, ValueError):
        return
    if layers <= 0:
        return
    names = tensor_names(folder)
    if names is None:
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
