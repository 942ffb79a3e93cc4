"""The policy interface and registry.

A policy answers "which cached tokens go?" (``select``) and knows everything else about itself: its
parameters (the ``Params`` dataclass the GUI builds its form from and the CLI its flags from), which tokens
it shows as attention sinks, the default priority of unmarked tokens. The session never asks a policy's
name; ``engine.core.eviction`` does the evicting, compaction and reporting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

registry: dict[str, type["EvictionPolicy"]] = {}

PINNED = 100  # priority of the system prompt and pinned messages (TensorRT-LLM's top retention priority)
DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority


@dataclass
class PolicyState:
    """What a policy may look at (CPU numpy, one row per layer; per layer and KV head, ``[L * H, n]``, for a
    ``per_head`` policy or once a layer's heads hold different tokens).

    positions  [rows, n] logical position of each cached token, per row (ascending)
    scores     [rows, n] accumulated attention each cached token received (H2O), or the attention the coming
               queries are expected to pay it (Expected Attention), or None
    protected  logical positions ``[0, protected)`` hold the system prompt / first message
    priorities [T] int 0..100 per logical position (the policy's default filled in), or None
    page_size  of the store (streaming evicts whole pages when it can)
    """

    positions: np.ndarray
    scores: np.ndarray | None = None
    protected: int = 0
    priorities: np.ndarray | None = None
    page_size: int = 16
    seq_len: int = 0
    turns: tuple[int, ...] = ()  # where each message of the chat starts (logical positions, ascending)


class EvictionPolicy:
    """Base class. Subclasses set ``name``, a ``Params`` dataclass and implement ``select``.

    ``select`` contract: for every row (layer, or layer and head), indices into the n cached tokens to drop so
    that exactly ``min(n, target)`` stay, for any ``target >= 1``. When what the policy protects (sinks, the
    protected prompt, pinned messages, the recent window) is more than ``target``, it protects less instead of
    failing; ``engine.core.eviction`` tells the user.
    """

    name: ClassVar[str] = "none"
    label: ClassVar[str] = "No eviction"
    listed: ClassVar[bool] = True  # offered in the GUI and the CLI (overflow helpers are not)
    needs_scores: ClassVar[bool] = False  # accumulate attention scores (explicit softmax)
    needs_queries: ClassVar[bool] = False  # score keys from the recent queries' statistics (``engine.core.expected``)
    rope_in_cache: ClassVar[bool] = False  # compaction re-rotates keys: positions are in-cache indices
    per_head: ClassVar[bool] = False  # each KV head keeps its own tokens (one ``PolicyState`` row per layer and head)

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
        if cls.name != "none" and cls.__dict__.get("listed", True):
            registry[cls.name] = cls

    def validate(self) -> None:
        for f in dataclasses.fields(self.params):
            v = getattr(self.params, f.name)
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            if isinstance(f.default, bool):  # a switch (the GUI's check box)
                if not isinstance(v, bool):
                    raise ValueError(f"policy {self.name}: {f.name} {v!r} is not true or false")
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"policy {self.name}: {f.name} {v!r} is not an integer")
            if lo is not None and v < lo:
                raise ValueError(f"policy {self.name}: {f.name} {v} must be >= {lo}")
            if hi is not None and v > hi:
                raise ValueError(f"policy {self.name}: {f.name} {v} must be <= {hi}")

    @property
    def scored(self) -> bool:
        """Ranks tokens by per-token scores the evictor keeps (``PolicyState.scores``)."""
        return self.needs_scores or self.needs_queries

    @property
    def budget(self) -> int:
        """Most tokens a layer may hold between steps."""
        raise NotImplementedError

    def slack(self, page_size: int) -> int:
        """Evict this many extra tokens at once, so compaction runs every few steps, not every step; never
        so many that what the policy always keeps would not fit."""
        return max(1, min(page_size, self.budget // 8))

    def select(self, state: PolicyState, target: int) -> list[np.ndarray]:
        raise NotImplementedError

    def sink_count(self, n_tokens: int) -> int:
        """Leading tokens shown as attention sinks in the token strip (StreamingLLM's)."""
        return 0

    def default_priority(self) -> int | None:
        """Priority of tokens no message marked (None: this policy does not use priorities)."""
        return None

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.params).items())
        return f"{self.name}({args})"

    @classmethod
    def flag_names(cls) -> dict[str, str]:
        """CLI flag (without ``--``) → ``Params`` field, from each field's ``flag`` metadata."""
        return {f.metadata["flag"]: f.name for f in dataclasses.fields(cls.Params) if f.metadata.get("flag")}


def policy_names() -> list[str]:
    return ["none", *registry]


def get_policy_class(name: str) -> type[EvictionPolicy] | None:
    """The class registered as ``name`` (None for "none"); ``ValueError`` if unknown."""
    if name == "none":
        return None
    cls = registry.get(name)
    if cls is None:
        raise ValueError(f"policy: {name!r} is not one of {', '.join(policy_names())}")
    return cls


def get_policy(name: str, params: dict[str, Any] | None = None) -> EvictionPolicy | None:
    """The policy called ``name`` built from ``params`` (None for "none"). ``ValueError`` if unknown."""
    cls = get_policy_class(name)
    return None if cls is None else cls(**(params or {}))


def policy_flags() -> dict[str, list[str]]:
    """Every CLI flag the listed policies declare → "policy: help" lines (for ``--help``)."""
    out: dict[str, list[str]] = {}
    for name, cls in registry.items():
        for f in dataclasses.fields(cls.Params):
            if f.metadata.get("flag"):
                out.setdefault(f.metadata["flag"], []).append(f"{name}: {f.metadata.get('help') or f.name}")
    return out


def param_field(default: Any, *, min: Any = None, max: Any = None, help: str = "", flag: str = "") -> Any:  # noqa: A002
    """A ``Params`` field with the metadata the GUI builds a control from and the CLI flag that sets it."""
    return field(default=default, metadata={"min": min, "max": max, "help": help, "flag": flag})


def drop_in_order(order: np.ndarray, n: int, target: int) -> np.ndarray:
    """The first ``n - target`` indices of ``order`` (a preference order over all n slots), sorted."""
    return np.sort(order[:max(0, n - target)]).astype(np.int64)


def config_from_flags(policy: str = "none", flags: dict[str, Any] | None = None, **fields: Any):
    """A ``CacheConfig`` from command-line values. ``flags`` maps policy flags (``sinks``, ``window``, ``budget``;
    None: not given) to the ``Params`` field of ``policy`` that declares that flag, so ``--window`` is a streaming
    window and an H2O or priority recent window alike. A flag the policy has no use for is a ``ValueError`` (it
    would otherwise be silently ignored)."""
    from engine.config import CacheConfig

    given = {k: v for k, v in (flags or {}).items() if v is not None}
    params: dict[str, Any] = {}
    if given:
        policy_cls = get_policy_class(policy)
        names = policy_cls.flag_names() if policy_cls is not None else {}
        for flag, value in given.items():
            if flag not in names:
                known = ", ".join(f"--{f}" for f in names) or "none"
                raise ValueError(f"--{flag.replace('_', '-')} does not apply to policy {policy} (its flags: {known})")
            params[names[flag]] = value
    return CacheConfig(policy=policy, policy_params=params, **fields)
