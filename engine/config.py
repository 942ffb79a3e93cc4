"""Frozen configuration objects: what to load, how to cache, how to sample.

Each validates itself in ``__post_init__`` and raises ``ValueError`` with a one-line message, so the CLI,
the app and tests share one set of rules.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

CACHE_MODES = ("off", "contiguous", "paged")
KV_DTYPES = ("auto", "int8", "int4", "tq4", "tq3", "tq2")  # K and V (tq: rotated, engine.kv.quantized.tq_schemes)
QJL_KEY_DTYPES = ("tq4-qjl", "tq3-qjl", "tq2-qjl")  # keys only: one of the bits a QJL sign of the residual
K_DTYPES = KV_DTYPES + QJL_KEY_DTYPES


def value_dtype(kv_dtype: str) -> str:
    """The values' precision of a K-and-V setting (``--kv-dtype tq3-qjl``: keys tq3-qjl, values tq3)."""
    return kv_dtype.removesuffix("-qjl")
QUANTIZATIONS = ("none", "int8", "nf4")
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "float16", "bfloat16")
OVERFLOWS = ("stop", "turns", "truncate_middle", "rolling", "policy")
# the overflow settings that evict to go on past the context; "turns" drops the oldest whole messages, never the
# system prompt, a pinned message or the latest one (``engine.policies.streaming.TurnsOverflow``)
OVERFLOW_EVICTS = ("turns", "truncate_middle", "rolling")
MAX_PAGE_SIZE = 256


class Need(enum.StrEnum):
    """What a cache setting needs from the rest of its ``CacheConfig`` to run (``CacheConfig.need``)."""

    CACHE = "cache"  # a cache that is on (contiguous or paged): there is something to evict from
    PAGED = "paged"  # the paged cache: int8 / int4 codes are kept per page
    POLICY = "policy"  # an eviction policy: overflow "policy" hands the choice to it


# What a field falls back to when its value's need is not met (``CacheConfig.fitted``), in the order the rules
# are read: the policy before the overflow, whose "policy" choice needs one.
FALLBACK = {"k_dtype": "auto", "v_dtype": "auto", "policy": "none", "overflow": "stop"}


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a local folder, a hub id, or ``"demo"`` (built-in random-weight model)."""

    source: str = "demo"
    dtype: str = "auto"  # auto: the checkpoint's dtype on CPU is forced to float32
    quantization: str = "none"
    device: str = "auto"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    allow_download: bool = True

    def __post_init__(self) -> None:
        if not self.source or not str(self.source).strip():
            raise ValueError("model: empty model path or id")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantize: {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.device not in DEVICES:
            raise ValueError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class CacheConfig:
    """How the KV cache of a chat session is kept.

    mode        off (recompute every step) | contiguous (one growing buffer per layer) | paged (page pool)
    page_size   tokens per page, 1..256 (paged mode)
    prefix_reuse  keep the cache across turns and prefill only what changed
    k_dtype / v_dtype  auto (the model's compute dtype) | int8 | int4 | tq4 | tq3 | tq2; keys also tq4-qjl | tq3-qjl |
                tq2-qjl (the tq kind of as many bits, one of them a QJL sign of the residual)
    policy      eviction policy name from ``engine.policies`` ("none", "streaming", "h2o", "expected", "priority")
    policy_params  keyword arguments for the policy's ``Params`` dataclass
    overflow    what happens when the context or budget is full: stop | turns | truncate_middle | rolling | policy
    max_pages   cap on the page pool (None: grow as needed up to the model's context)
    checkpoints positions kept per chat that a hybrid / sliding-window model's cache can be cut back to (the
                recurrent states copied there, the window's pages held): 0..64, 0 off (``engine.kv.store.checkpoints``)
    """

    mode: str = "paged"
    page_size: int = 16
    prefix_reuse: bool = True
    k_dtype: str = "auto"
    v_dtype: str = "auto"
    policy: str = "none"
    policy_params: dict[str, Any] = field(default_factory=dict)
    overflow: str = "stop"
    max_pages: int | None = None
    checkpoints: int = 8  # llama.cpp's --ctx-checkpoints default: a follow-up, a branch and a regenerate of 2-3 turns

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise ValueError(f"cache mode: {self.mode!r} is not one of {', '.join(CACHE_MODES)}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int):
            raise ValueError(f"page size: {self.page_size!r} is not an integer")
        if not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page size: {self.page_size} is outside 1..{MAX_PAGE_SIZE}")
        if self.v_dtype in QJL_KEY_DTYPES:
            raise ValueError(f"v_dtype: {self.v_dtype!r} is for keys only (values use "
                             f"{self.v_dtype.removesuffix('-qjl')}: the QJL residual keeps query-key products unbiased)")
        for name, kinds in (("k_dtype", K_DTYPES), ("v_dtype", KV_DTYPES)):
            if getattr(self, name) not in kinds:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(kinds)}")
        if self.overflow not in OVERFLOWS:
            raise ValueError(f"overflow: {self.overflow!r} is not one of {', '.join(OVERFLOWS)}")
        if self.max_pages is not None and self.max_pages < 1:
            raise ValueError(f"max pages: {self.max_pages} must be at least 1")
        if isinstance(self.checkpoints, bool) or not isinstance(self.checkpoints, int) or not 0 <= self.checkpoints <= 64:
            raise ValueError(f"checkpoints: {self.checkpoints!r} is not an integer in 0..64")
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError("policy: empty policy name")
        if not isinstance(self.policy_params, dict):
            raise ValueError(f"policy parameters: {self.policy_params!r} is not a mapping")

    def replace(self, **changes: Any) -> "CacheConfig":
        return dataclasses.replace(self, **changes)

    # -- the rules every surface asks (the engine, the server, the app's send check): stated once, here --
    @property
    def overflow_evicts(self) -> bool:
        """The overflow setting drops tokens to go on when the context is full (``truncate_middle``, ``rolling``)."""
        return self.overflow in OVERFLOW_EVICTS

    @property
    def evicts_to_fit(self) -> bool:
        """The cache makes room itself — an eviction policy, or an overflow setting that drops tokens, on a
        cache that is on — so a reply never stops at the context's end."""
        return self.mode != "off" and (self.policy != "none" or self.overflow_evicts)

    @staticmethod
    def need(name: str, value: Any) -> Need | None:
        """What the value ``value`` of the field ``name`` needs from the rest of the config (None: nothing). The
        engine refuses a config whose need is not met (``engine.core.reconfigure.validate``)."""
        if name in ("k_dtype", "v_dtype") and value != "auto":
            return Need.PAGED
        if name == "policy" and value != "none":
            return Need.CACHE
        if name == "overflow" and value in OVERFLOW_EVICTS:
            return Need.CACHE
        if name == "overflow" and value == "policy":
            return Need.POLICY
        return None

    def has(self, need: Need) -> bool:
        """This config meets ``need``."""
        return {Need.CACHE: self.mode != "off", Need.PAGED: self.mode == "paged",
                Need.POLICY: self.policy != "none"}[need]

    def unmet(self, name: str, value: Any = None) -> Need | None:
        """The need of ``value`` (default: the field's own value) for the field ``name`` that this config does not
        meet, or None when it could run."""
        need = self.need(name, getattr(self, name) if value is None else value)
        return need if need is not None and not self.has(need) else None

    def fitted(self) -> "CacheConfig":
        """This config with every value whose need is unmet set to its fallback (``FALLBACK``): one that runs."""
        cfg = self
        for name, fallback in FALLBACK.items():
            if cfg.unmet(name) is not None:
                cfg = cfg.replace(**{name: fallback}, **({"policy_params": {}} if name == "policy" else {}))
        return cfg

    @property
    def bounded_by_context(self) -> bool:
        """Nothing is ever dropped (no policy, overflow ``stop``): the context bounds a chat's length."""
        return self.policy == "none" and self.overflow == "stop"

    @property
    def needs_spans(self) -> bool:
        """Eviction may drop tokens, so it needs to know where each message starts (protected, pinned)."""
        return not self.bounded_by_context

    @property
    def quantized(self) -> bool:
        return self.k_dtype != "auto" or self.v_dtype != "auto"


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings. ``temperature == 0`` is greedy; ``seed`` makes sampling repeatable."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    ignore_eos: bool = False  # a stop token does not end the reply (it is part of it): max new tokens does
    min_new_tokens: int = 0  # until the reply has this many, stop tokens are not chosen and stop strings not looked for
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the reply (vLLM's), whatever ignore_eos says
    stop_strings: tuple[str, ...] = ()
    presence_penalty: float = 0.0  # OpenAI's: minus this from a token's logit once it was generated in the reply
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often it was generated in the reply
    logprobs: int | None = None  # record the chosen token's log-probability and this many top alternatives
    grammar: Any = None  # engine.core.grammar.Grammar: every token chosen is one it allows (structured output)

    def __post_init__(self) -> None:
        # types first: NaN passes every ``<`` check below, and a str or None would raise TypeError there
        for name, label in (("temperature", "temperature"), ("top_p", "top-p"), ("min_p", "min-p"),
                            ("repetition_penalty", "repetition penalty")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{label}: {value!r} is not a number")
            if not math.isfinite(value):
                raise ValueError(f"{label}: {value} is not a finite number")
        for name, label in (("top_k", "top-k"), ("max_new_tokens", "max new tokens"), ("seed", "seed"),
                            ("min_new_tokens", "min new tokens")):
            value = getattr(self, name)
            if (value is not None or name != "seed") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{label}: {value!r} is not an integer")
        if self.temperature < 0:
            raise ValueError(f"temperature: {self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top-k: {self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p: {self.top_p} must be in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min-p: {self.min_p} must be in [0, 1)")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition penalty: {self.repetition_penalty} must be > 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max new tokens: {self.max_new_tokens} must be at least 1")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop token ids: {self.stop_token_ids!r} must be token ids (integers >= 0)")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min new tokens: {self.min_new_tokens} must be in 0..{self.max_new_tokens} "
                             "(max new tokens)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name.replace('_', ' ')}: {value!r} must be a number in [-2, 2]")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs: {self.logprobs!r} must be an integer 0..{MAX_TOP_LOGPROBS}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            raise ValueError(f"seed: {self.seed} is outside -2**63 .. 2**64-1 (what a generator's seed can hold)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> "SamplingConfig":
        return dataclasses.replace(self, **changes)


SPEC_METHODS = ("off", "ngram", "draft")  # speculative decoding (engine.core.verify)
MAX_DRAFT = 16  # a verification of 17 tokens costs ~1.3x a decode forward on the CPU; more rarely pays


def _check_draft_path(path: str) -> None:
    """A draft model named by a local path that does not exist: said before the main model loads (seconds to
    minutes), naming the draft model. A hub id (``org/name``) is left to the loader."""
    from pathlib import Path

    if not path or path == "demo" or Path(path).expanduser().exists():
        return
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(f"draft model {path}: no such folder (give a model folder, or a hub id like org/name)")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding for a chat: ``method`` off | ngram | draft (``draft_path``: the draft model),
    ``draft_tokens`` k per forward (0: adaptive, from 4 between 1 and 16), ``max_ngram`` the longest
    n-gram prompt lookup matches, ``auto_off`` stop speculating for a reply where it measures slower."""

    method: str = "off"
    draft_path: str = ""
    draft_tokens: int = 0
    max_ngram: int = 3
    auto_off: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative: {self.method!r} is not one of {', '.join(SPEC_METHODS)}")
        if self.method == "draft" and not self.draft_path:
            raise ValueError("speculative: a draft model needs its path (draft:PATH)")
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) \
                or not 0 <= self.draft_tokens <= MAX_DRAFT:
            raise ValueError(f"draft tokens: {self.draft_tokens!r} must be 0 (adaptive) .. {MAX_DRAFT}")
        if isinstance(self.max_ngram, bool) or not isinstance(self.max_ngram, int) or not 1 <= self.max_ngram <= 8:
            raise ValueError(f"max n-gram: {self.max_ngram!r} must be 1..8")

    @classmethod
    def parse(cls, text: str, draft_tokens: int = 0) -> "SpecConfig":
        """``off`` | ``ngram`` | ``draft:PATH`` (the CLI's and the server's spelling)."""
        text = (text or "off").strip()
        if text.startswith("draft:"):
            path = text[len("draft:"):]
            _check_draft_path(path)
            return cls(method="draft", draft_path=path, draft_tokens=draft_tokens)
        return cls(method=text, draft_tokens=draft_tokens)

    @property
    def label(self) -> str:
        return f"draft:{self.draft_path}" if self.method == "draft" else self.method
