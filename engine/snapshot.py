"""The frozen objects the GUI sees: ``ModelInfo``, ``CacheSnapshot``, ``TokenEvent`` (and ``StepResult``).

They hold plain Python values and CPU numpy arrays copied out of the engine, never live tensors, so they
can cross threads and be kept for plots and exports.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

# Page states, as stored in ``CacheSnapshot.page_state`` (int8 codes; defined with the pool that owns them).
from engine.kv.paged.pool import (  # noqa: E402,F401 - re-exported for the GUI (plain ints, no torch)
    PAGE_ACTIVE,
    PAGE_CACHED,
    PAGE_EVICTED,
    PAGE_FREE,
    PAGE_OFFLOADED,
    PAGE_PINNED,
    PAGE_QUANTIZED,
    PAGE_SHARED,
    PAGE_STATE_NAMES,
)

# Token states, as stored in ``CacheSnapshot.token_state`` (int8 codes, one per logical position).
TOKEN_KEPT = 0
TOKEN_SINK = 1
TOKEN_EVICTED = 2
TOKEN_QUANTIZED = 3
TOKEN_PINNED = 4
TOKEN_NOT_CACHED = 5  # cache off, or not fed yet (a prefill in chunks, the token just sampled)
TOKEN_PARTIAL = 6  # a per-head eviction dropped it from some KV heads of every layer; others keep it
TOKEN_STATE_NAMES = ("kept", "sink", "evicted", "quantized", "pinned", "not cached", "kept by some heads")


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded, and where. ``kv_bytes_per_token`` is for the full-precision cache."""

    name: str
    source: str
    architecture: str
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int
    dtype: str
    kv_dtype: str
    device: str
    device_reason: str
    quantization: str
    weights_bytes: int
    kv_bytes_per_token: int
    is_demo: bool = False
    has_chat_template: bool = False
    stop_ids: tuple[int, ...] = ()
    # per layer, what it caches (``engine.model.arch``): "full" | "sliding" | "state" | "none", and sliding windows
    layer_kinds: tuple[str, ...] = ()
    windows: tuple[int, ...] = ()
    k_heads: int = 0  # what attention layers cache, from the tensors the model produced
    k_dim: int = 0
    v_heads: int = 0
    v_dim: int = 0
    state_bytes: int = 0  # recurrent / convolution state of all state layers, per chat
    attn_impl: str = "sdpa"
    unsupported: str = ""  # why chat sessions cannot run this model (one line), "" when they can
    threads: int = 0  # CPU threads torch uses for it (``engine.model.threads``), and why
    threads_reason: str = ""
    cpu_features: str = ""  # the CPU's vector level and native bf16 (``engine.model.threads.cpu_features``), CPU only
    weights_kernel: str = ""  # how the linears' weights are held for the CPU's kernels (``engine.model.prepack``)
    # the weights as loaded (``engine.model.weights_plan``): their format ("Q4_K_M", "BF16", "F32", "int8", "NF4"),
    # the file's where they differ, how they are held ("mapped", "repacked", "read", "converted", "quantized",
    # "dequantized") and bits per weight as held (``weights_bytes`` x 8 / parameters)
    weights_format: str = ""
    weights_stored: str = ""
    weights_held: str = ""
    weights_bits: float = 0.0

    @property
    def layer_bytes_per_token(self) -> int:
        """Bytes one token takes in one attention layer (K and V) at the model's precision."""
        if self.k_heads:
            return self.kv_bytes_per_token // max(1, self.attention_layers)
        return self.kv_bytes_per_token // max(1, self.num_layers)

    @property
    def attention_layers(self) -> int:
        return (sum(1 for k in self.layer_kinds if k.split("+")[0] in ("full", "sliding")) if self.layer_kinds
                else self.num_layers)

    def kv_bytes_at(self, tokens: int) -> int:
        """Bytes of the cache holding ``tokens`` tokens: full layers hold all of them, sliding layers at most
        ``window - 1`` (what the next query needs besides itself, as HF's cache keeps); plus the fixed state
        of state layers."""
        if not self.layer_kinds:
            return self.kv_bytes_per_token * tokens
        per = self.layer_bytes_per_token
        held = sum(tokens if k.startswith("full") else min(tokens, w - 1) if k.startswith("sliding") else 0
                   for k, w in zip(self.layer_kinds, self.windows))
        return per * held + self.state_bytes

    @property
    def layer_summary(self) -> str:
        """E.g. "26 layers: 22 sliding (window 512) · 4 full"."""
        if not self.layer_kinds:
            return f"{self.num_layers} layers: {self.num_layers} full"
        labels = {"full": "full", "sliding": "sliding", "state": "state (recurrent/conv)", "full+state": "full + state",
                  "sliding+state": "sliding + state", "none": "no cache"}
        parts = []
        for kind, label in labels.items():
            n = self.layer_kinds.count(kind)
            if not n:
                continue
            if kind.startswith("sliding"):
                ws = sorted({w for k, w in zip(self.layer_kinds, self.windows) if k == kind})
                label += f" (window {', '.join(str(w) for w in ws)})"
            parts.append(f"{n} {label}")
        return f"{len(self.layer_kinds)} layers: " + " · ".join(parts)

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_q_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"

    def kv_bytes_per_token_as(self, kv_heads: int) -> int:
        """Bytes per token the same model would need with ``kv_heads`` KV heads (MHA: q heads, MQA: 1)."""
        return self.kv_bytes_per_token * kv_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attention_kind"] = self.attention_kind
        return d


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``phase`` is "prefill" for the first token of a reply, else "decode"."""

    generation_id: int
    index: int  # 0-based index of this token within the reply
    token_id: int
    text_delta: str
    phase: str
    step_ms: float
    tokens_in_step: int  # tokens the forward pass processed (prompt length for prefill, 1 for decode)
    path: str = "eager"  # what ran the forward: eager | compiled (engine.model.fast_step) | batched | speculative
    draft: bool = False  # a draft token the model's verification accepted (``engine.core.verify``)


@dataclass(frozen=True)
class CacheSnapshot:
    """The state of a session's KV cache after one step. Arrays are CPU numpy copies."""

    generation_id: int
    step: int
    mode: str
    policy: str
    page_size: int
    num_pages: int
    pages_used_per_layer: np.ndarray  # [L] int
    tokens_per_layer: np.ndarray  # [L] int (tokens held per layer; differ under per-layer eviction)
    bytes_per_layer: np.ndarray  # [L] int (bytes really held: codes + scales for quantized pages)
    capacity_tokens: int  # tokens the cache can hold per layer now (pool or buffer capacity)
    page_state: np.ndarray  # [num_pages] int8, PAGE_* codes
    page_owner: np.ndarray  # [num_pages] int32, turn index that wrote the page, -1 free
    page_fill: np.ndarray  # [num_pages] int32, tokens in the page
    page_refcount: np.ndarray  # [num_pages] int32
    token_state: np.ndarray  # [T] int8, TOKEN_* codes per logical position of the conversation
    weights_bytes: int
    kv_bytes: int
    device_bytes: int  # device memory in use (CUDA), 0 elsewhere
    reused_tokens: int
    recomputed_tokens: int
    first_divergence: int  # position where this turn's prompt left the cached tokens (-1 none cached)
    seq_len: int  # logical tokens in the conversation so far
    context_length: int
    k_dtype: str = "auto"
    v_dtype: str = "auto"
    evicted_total: int = 0
    evicted_positions: tuple[int, ...] = ()  # positions evicted on this step
    evict_reason: str = ""
    phase: str = "decode"
    step_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    policy_ms: float = 0.0  # the eviction policy's own work in this step's forward (observing, scoring, choosing)
    policy_prefill_ms: float = 0.0  # ... over this reply's prefill
    policy_decode_ms: float = 0.0  # ... over this reply's decode steps
    offloaded: bool = False
    notes: tuple[str, ...] = ()
    page_groups: tuple[tuple[str, int], ...] = ()  # models whose layers differ: (label, pages) per pool, in order
    layer_kinds: tuple[str, ...] = ()  # per layer: "full", "sliding", "state", "full+state", "none" (ModelInfo's)
    written_pages: tuple[int, ...] = ()  # pages of the map the step's forward wrote (every session's, if batched)
    restored_pages: tuple[int, ...] = ()  # this chat's pages its turn took from the KV disk tier (engine.kv.tier.disk)
    batch_size: int = 1  # sessions whose tokens that forward decoded together (engine.batch)
    verified: int = 0  # slots a speculative verification wrote (the fed token + its drafts; 0: no verification)
    rolled_back: int = 0  # of them, the rejected drafts' slots cut back (their pages freed if emptied)
    step_path: str = "eager"  # what ran that forward: eager | compiled | batched (TokenEvent.path)
    fast_step: str = ""  # the model's compiled decode step in words (engine.model.fast_step.FastStep.describe)
    page_mine: np.ndarray | None = None  # [num_pages] bool: held by this chat (else: free, cached, other chats')
    # where a hybrid / sliding-window cache can be cut back to (``engine.kv.store.checkpoints``; none on plain models)
    checkpoints: tuple[int, ...] = ()  # positions (tokens fed before each), ascending
    checkpoint_sizes: tuple[int, ...] = ()  # bytes of each: its states' copy + window pages the live windows gave back
    checkpoint_bytes: int = 0  # all of them (states' copies + window pages held only by checkpoints; not in kv_bytes)
    checkpoint_pages: tuple[int, ...] = ()  # pages of the map held only by checkpoints (old windows of sliding groups)
    account: "CacheAccount | None" = None  # how this turn's prompt used the cache (``TurnStats.cache``)
    # (start, end, kind, number) of each message in the conversation's tokens, where a viewer knows them (an API
    # conversation's: ``engine.server.message_kinds``); kinds system / user / assistant / tool_call / tool_result / reply
    messages: tuple[tuple[int, int, str, int], ...] = ()

    def __post_init__(self) -> None:
        # Frozen means frozen: every array is the snapshot's own read-only copy, so a panel (or a thread)
        # can never change what another one sees. (Only the fields declared arrays are looked at: a snapshot is made
        # each token, and walking all ~60 fields took ~20 us of it.)
        for name in _array_fields():
            v = getattr(self, name)
            if isinstance(v, np.ndarray):
                a = np.array(v, copy=True)
                a.flags.writeable = False
                object.__setattr__(self, name, a)

    @property
    def pages_used(self) -> int:
        return int(np.count_nonzero((self.page_state != PAGE_FREE) & (self.page_state != PAGE_CACHED)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (arrays become lists)."""
        out: dict[str, Any] = {}
        for k, v in asdict(self).items():
            if isinstance(v, np.ndarray):
                out[k] = v.tolist()
            elif isinstance(v, tuple):
                out[k] = list(v)
            else:
                out[k] = v
        return out


_ARRAY_FIELDS: tuple[str, ...] | None = None


def _array_fields() -> tuple[str, ...]:
    """The ``CacheSnapshot`` fields declared numpy arrays (their annotations name ``np.ndarray``), found once."""
    global _ARRAY_FIELDS
    if _ARRAY_FIELDS is None:
        _ARRAY_FIELDS = tuple(f.name for f in fields(CacheSnapshot) if "ndarray" in str(f.type))
    return _ARRAY_FIELDS


class MissReason(str, enum.Enum):
    """Why a prompt token was computed instead of read from the cache: one fixed vocabulary for every surface."""

    __str__ = str.__str__

    NEW = "new"  # this cache never held it
    DIVERGED = "diverged"  # the prompt differs from the cached one from here on
    EVICTED = "evicted"  # dropped for room (the context, the pool)
    POLICY = "policy"  # an eviction policy dropped it
    PARTIAL_PAGE = "partial_page"  # reused in whole pages only
    SETTINGS = "settings"  # a setting (prefix reuse, page size, precision, model) kept it from being reused
    WINDOW = "window"  # a sliding-window layer no longer held it
    STATE = "state"  # no checkpoint of a recurrent layer there
    DISK = "disk"  # its page file was missing or damaged
    OFF = "off"  # the cache is off


@dataclass(frozen=True)
class Miss:
    """Prompt tokens ``[start, end)`` computed, and why (``detail``: one line in the engine's plain words)."""

    start: int
    end: int
    reason: MissReason
    detail: str = ""

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "reason": str(self.reason.value), "detail": self.detail}


@dataclass(frozen=True)
class CacheAccount:
    """How one prompt used the cache: ``reused + recomputed + dropped == prompt`` and the misses cover the
    recomputed tokens, in order (``engine.core.account`` builds it)."""

    prompt: int = 0
    reused: int = 0
    recomputed: int = 0
    dropped: int = 0  # evicted earlier and passed over (a stream that goes on under a policy): never computed
    misses: tuple[Miss, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"reused": self.reused, "recomputed": self.recomputed, "dropped": self.dropped,
                "misses": [m.to_dict() for m in self.misses]}


@dataclass(frozen=True)
class TurnStats:
    """How one turn used the cache and how fast it ran."""

    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    first_divergence: int
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    policy_prefill_ms: float = 0.0  # the eviction policy's own work (H2O's scores, Expected Attention's scoring)
    policy_decode_ms: float = 0.0  # ... in the decode steps (ms over the reply)
    reprefilled_tokens: int = 0  # tokens read again after cache changes during the reply (not in recomputed_tokens)
    reprefill_ms: float = 0.0  # reading them (in none of ttft_ms, prefill_ms, decode_ms)
    reprefills: tuple = ()  # each change's ``engine.core.records.Reprefill`` (tokens, ms, the settings before/after)
    stop_reason: str = ""
    shared_tokens: int = 0  # of reused_tokens, those taken from pages other sessions computed (prefix cache)
    disk_restored_tokens: int = 0  # of shared_tokens, those read from the KV disk tier (engine.kv.tier.disk)
    disk_ms: float = 0.0  # reading them
    disk_again_ms: float = 0.0  # what computing them would take at the model's measured prefill rate
    dropped_tokens: int = 0  # prompt tokens dropped unread to fit the context (in neither reused nor recomputed)
    threads: int = 0  # CPU threads torch used (0: not on the CPU)
    forwards: int = 0  # forwards that gave tokens (the first token's, then decode or verification forwards)
    speculative: str = ""  # the drafter ("ngram", "draft:PATH"; "" without speculation)
    draft_tokens: int = 0  # draft tokens verified
    accepted_draft_tokens: int = 0  # of them, those the model kept
    accepted_by_position: tuple[int, ...] = ()  # accepted drafts at draft position 1, 2, ...
    verifications: int = 0  # speculative verification forwards
    spec_note: str = ""  # "speculative: 212 of 290 draft tokens accepted (73%), 2.1 tokens per forward"
    cache: CacheAccount | None = None  # why each prompt token was reused or computed


@dataclass(frozen=True)
class StepResult:
    """What one ``ChatSession.step()`` produced. ``event`` is None when the step generated nothing."""

    event: TokenEvent | None
    snapshot: CacheSnapshot | None
    done: bool
    stop_reason: str = ""  # eos | stop_string | max_tokens | cancelled | context_full | budget_full
    text: str = ""  # the whole reply so far
    stats: TurnStats | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)
    reprefill: Any = None  # a re-prefill after a cache change this step moved on (``engine.core.records.Reprefill``)
