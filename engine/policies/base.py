"""The policy interface and registry."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

registry: dict[str, type["EvictionPolicy"]] = {}


@dataclass
class PolicyState:
    """What a policy may look at (CPU numpy, one row per layer).

    positions  [L, n] logical position of each cached token, per layer (ascending)
    scores     [L, n] accumulated attention each cached token received (H2O), or None
    protected  logical positions ``[0, protected)`` hold the system prompt / first message
    priorities [T] int 0..100 per logical position (priority policy), or None
    page_size  of the store (streaming evicts whole pages when it can)
    """

    positions: np.ndarray
    scores: np.ndarray | None = None
    protected: int = 0
    priorities: np.ndarray | None = None
    page_size: int = 16
    seq_len: int = 0


class EvictionPolicy:
    """Base class. Subclasses set ``name``, a ``Params`` dataclass and implement ``select``."""

    name: ClassVar[str] = "none"
    label: ClassVar[str] = "No eviction"
    needs_scores: ClassVar[bool] = False  # accumulate attention scores (explicit softmax)
    rope_in_cache: ClassVar[bool] = False  # compaction re-rotates keys: positions are in-cache indices

    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, params: Any = None, **kwargs: Any) -> None:
        if params is None:
            names = {f.name for f in dataclasses.fields(self.Params)}
            unknown = sorted(set(kwargs) - names)
            if unknown:
                raise ValueError(f"policy {self.name}: unknown parameter(s) {', '.join(unknown)}; "
                                 f"expected {', '.join(sorted(names)) or 'none'}")
            params = self.Params(**kwargs)
        self.params = params
        self.validate()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.name != "none":
            registry[cls.name] = cls

    def validate(self) -> None:
        for f in dataclasses.fields(self.params):
            v = getattr(self.params, f.name)
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if lo is not None and v < lo:
                    raise ValueError(f"policy {self.name}: {f.name} {v} must be >= {lo}")
                if hi is not None and v > hi:
                    raise ValueError(f"policy {self.name}: {f.name} {v} must be <= {hi}")

    @property
    def budget(self) -> int:
        """Most tokens a layer may hold between steps."""
        raise NotImplementedError

    def slack(self, page_size: int) -> int:
        """Evict this many extra tokens at once, so compaction runs every few steps, not every step."""
        return max(1, min(page_size, self.budget // 8))

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        """Per layer, the *indices into the cached tokens* (0..n-1) to evict so that n - len == target."""
        raise NotImplementedError

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.params).items())
        return f"{self.name}({args})"


class NoPolicy(EvictionPolicy):
    name = "none"


def policy_names() -> list[str]:
    return ["none", *registry]


def get_policy(name: str, params: dict[str, Any] | None = None) -> EvictionPolicy | None:
    """The policy called ``name`` built from ``params`` (None for "none"). ``ValueError`` if unknown."""
    if name == "none":
        return None
    cls = registry.get(name)
    if cls is None:
        raise ValueError(f"policy: {name!r} is not one of {', '.join(policy_names())}")
    return cls(**(params or {}))


def param_field(default: Any, *, min: Any = None, max: Any = None, help: str = "") -> Any:  # noqa: A002
    """A ``Params`` field with the metadata the GUI builds a control from."""
    return field(default=default, metadata={"min": min, "max": max, "help": help})
