"""What the GUI knows about eviction policies: their names and ``Params`` dataclasses, read from
``engine.policies`` (falls back to ``["none"]`` while the engine has no registry).

Importing the registry must not import torch; if it would (or fails), only "none" is offered.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


def _registry() -> dict[str, Any]:
    try:
        mod = importlib.import_module("engine.policies")
    except Exception:  # noqa: BLE001 - an absent or broken registry just means "none"
        return {}
    for attr in ("registry", "REGISTRY", "POLICIES"):
        reg = getattr(mod, attr, None)
        if reg is None:
            continue
        if isinstance(reg, dict):
            return dict(reg)
        for inner in ("REGISTRY", "POLICIES", "registry"):
            d = getattr(reg, inner, None)
            if isinstance(d, dict):
                return dict(d)
        if callable(getattr(reg, "available", None)) and callable(getattr(reg, "get", None)):
            try:
                return {name: reg.get(name) for name in reg.available()}
            except Exception:  # noqa: BLE001
                return {}
    if callable(getattr(mod, "available", None)) and callable(getattr(mod, "get", None)):
        try:
            return {name: mod.get(name) for name in mod.available()}
        except Exception:  # noqa: BLE001
            return {}
    return {}


def policy_names() -> list[str]:
    names = list(_registry())
    if "none" not in names:
        names.insert(0, "none")
    return names


def policy_params(name: str) -> list[dataclasses.Field]:
    """The fields of the policy's ``Params`` dataclass (empty when it has none)."""
    cls = _registry().get(name)
    params = getattr(cls, "Params", None)
    if params is None or not dataclasses.is_dataclass(params):
        return []
    return list(dataclasses.fields(params))


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def policy_doc(name: str) -> str:
    cls = _registry().get(name)
    label = getattr(cls, "label", "")
    if label:
        return str(label)
    doc = (getattr(cls, "__doc__", "") or "").strip()
    return doc.splitlines()[0] if doc else ""


def policy_tip(name: str) -> str:
    """What the policy does to memory, speed and quality (the glossary's words, else its own label)."""
    from app.ground.glossary import POLICIES

    term = POLICIES.get(name)
    return term.tip if term else policy_doc(name) or name


def policy_summary(name: str) -> str:
    """One line under the policy list: what it keeps."""
    return policy_tip(name).splitlines()[0] if name != "none" else ""
