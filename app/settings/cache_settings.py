"""Settings ↔ engine configs, generated from the dataclass fields.

``cache_from_settings`` / ``save_cache`` and ``sampling_from_settings`` / ``save_sampling`` walk the fields
``app.settings.store.dataclass_settings`` declared, so neither the field list nor the conversion is written out
by hand; ``model_spec`` is the one place a ``ModelSpec`` is built from the saved model choices.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from app.settings.store import CACHE_DEFAULTS, CACHE_SKIP, SAMPLING_SKIP, Settings
from engine.model.builtin import BUILTIN_MODEL, is_builtin
from engine.config import CacheConfig, ModelSpec, SamplingConfig

T = TypeVar("T")


def _names(cls: type, skip: tuple[str, ...]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name not in skip]


def _load(settings: Settings, prefix: str, cls: type[T], skip: tuple[str, ...],
          defaults: dict[str, Any] | None = None) -> T:
    values: dict[str, Any] = {}
    for name in _names(cls, skip):
        value = settings.get(f"{prefix}/{name}")
        values[name] = None if name == "seed" and value < 0 else value
    try:
        return cls(**values)
    except (TypeError, ValueError):  # a hand-edited or outdated INI file: the defaults, never a crash
        return cls(**(defaults or {}))


def _save(settings: Settings, prefix: str, cfg: Any, skip: tuple[str, ...]) -> None:
    for name in _names(type(cfg), skip):
        value = getattr(cfg, name)
        settings.set(f"{prefix}/{name}", -1 if value is None and name == "seed" else value)


def cache_from_settings(settings: Settings) -> CacheConfig:
    """The saved cache settings (the defaults if they are not valid any more), fitted to run: a value whose need
    the rest does not meet (a cache that is off saved before drop-the-oldest became the default) falls back."""
    return _load(settings, "cache", CacheConfig, CACHE_SKIP, CACHE_DEFAULTS).fitted()


def save_cache(settings: Settings, cfg: CacheConfig) -> None:
    """``cfg`` as the user's defaults: what a new chat starts with (each chat keeps its own: ``chat_cache``)."""
    _save(settings, "cache", cfg, CACHE_SKIP)


def chat_cache(own: dict, defaults: CacheConfig) -> CacheConfig:
    """A chat's own cache settings (``Chat.own_settings``' "cache"), fitted to run; ``defaults`` where it has none
    saved or they are not valid any more (a hand-edited file, a field renamed)."""
    found = own.get("cache") if isinstance(own, dict) else None
    if not isinstance(found, dict):
        return defaults
    names = _names(CacheConfig, CACHE_SKIP)
    try:
        return CacheConfig(**{k: v for k, v in found.items() if k in names}).fitted()
    except (TypeError, ValueError):
        return defaults


def chat_settings_json(own: dict, cfg: Any, part: str = "cache") -> str:
    """``own`` (a chat's saved settings) with its ``part`` ("cache": a ``CacheConfig``, "spec": a ``SpecConfig``)
    set to ``cfg``, as the history row keeps them."""
    out = dict(own) if isinstance(own, dict) else {}
    out[part] = {name: getattr(cfg, name) for name in _names(type(cfg), CACHE_SKIP if part == "cache" else ())}
    return json.dumps(out, sort_keys=True)


def chat_spec(own: dict, defaults: T) -> T:
    """A chat's own speculation (``Chat.own_settings``' "spec"); ``defaults`` where it has none or it is not valid."""
    found = own.get("spec") if isinstance(own, dict) else None
    if not isinstance(found, dict):
        return defaults
    names = _names(type(defaults), ())
    try:
        return type(defaults)(**{k: v for k, v in found.items() if k in names})
    except (TypeError, ValueError):
        return defaults


def sampling_from_settings(settings: Settings) -> SamplingConfig:
    """The saved sampling settings for new replies (seed -1 is random)."""
    return _load(settings, "sampling", SamplingConfig, SAMPLING_SKIP)


def save_sampling(settings: Settings, cfg: SamplingConfig) -> None:
    _save(settings, "sampling", cfg, SAMPLING_SKIP)


def model_spec(settings: Settings, source: str) -> ModelSpec:
    """What to load for ``source`` with the saved weights choice and device (the demo and the built-in
    stories260K are never quantized: the saved choice belongs to a bigger model, and 8-bit of 1 MB saves nothing)."""
    device = settings.get("model/device")
    if source == "demo" or is_builtin(source):
        return ModelSpec(source=BUILTIN_MODEL if is_builtin(source) else "demo", device=device)
    return spec_for(source, settings.get("model/quantization"), device)


def spec_for(source: str, weights: str, device: str) -> ModelSpec:
    """A ``ModelSpec`` from the models dialog's "weights" choice: none / int8 / nf4 (bitsandbytes), or "bf16"
    (no quantization, computed in bfloat16: half float32's bytes; prompts ~3x faster where the CPU has native
    bf16)."""
    if weights == "bf16":
        return ModelSpec(source=source, quantization="none", dtype="bfloat16", device=device)
    return ModelSpec(source=source, quantization=weights, device=device)


def weights_choice(spec: ModelSpec) -> str:
    """The "weights" choice that gives ``spec`` (``spec_for``'s inverse), as saved in the settings."""
    return "bf16" if spec.dtype == "bfloat16" and spec.quantization == "none" else spec.quantization
