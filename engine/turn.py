"""One reply's bookkeeping, apart from the cache: its sampling and timings (``TurnState``), which tokens of
the chat are protected from eviction and at what priority (``protection``), and the shared prefix that
prefix reuse keeps (``common_prefix``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from engine.config import SamplingConfig
from engine.errors import ContextOverflowError
from engine.policies import PINNED
from engine.sampling import Sampler
from engine.snapshot import TurnStats


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class NullDecoder:
    """Stands in for ``StreamDecoder`` when a model has no tokenizer (benchmark shapes): ids only."""

    text = ""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class TurnState:
    """One reply's sampling, text and timings (replaced at every ``start``)."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sampler: Sampler | None = None
    decoder: Any = None
    generated: list[int] = field(default_factory=list)
    cancel: bool = False
    step: int = 0
    t_start: float = 0.0
    prefill_ms: float = 0.0  # every chunk of the prefill and the forward that gave the first token
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    prompt_len: int = 0
    reused: int = 0
    recomputed: int = 0
    divergence: int = -1
    shared: int = 0  # reused tokens taken from the prefix cache (pages other sessions computed)
    threads: int = 0

    def stats(self, reason: str) -> TurnStats:
        n = len(self.generated)
        return TurnStats(
            prompt_tokens=self.prompt_len, reused_tokens=self.reused, recomputed_tokens=self.recomputed,
            first_divergence=self.divergence, generated_tokens=n, ttft_ms=self.ttft_ms,
            prefill_ms=self.prefill_ms, decode_ms=self.decode_ms,
            decode_tokens_per_s=(max(0, n - 1) / (self.decode_ms / 1000.0)) if self.decode_ms > 0 else 0.0,
            prefill_tokens_per_s=(self.recomputed / (self.prefill_ms / 1000.0)) if self.prefill_ms > 0 else 0.0,
            stop_reason=reason, shared_tokens=self.shared, threads=self.threads,
        )


def protection(messages: Sequence[dict] | None, spans: Sequence[tuple[int, int]],
               n: int) -> tuple[int, np.ndarray | None]:
    """(protected, priorities) of a chat of ``n`` tokens: the system prompt(s) and the first user message are
    protected (what "truncate the middle" keeps); system and pinned messages get ``PINNED``, messages with a
    ``priority`` get it, the rest -1 (the policy's default)."""
    if not messages or not spans:
        return 0, None
    protected = 0
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is not None:
        protected = min(spans[first_user][1], n)
    pri = np.full(n, -1, dtype=np.int64)
    for m, (a, b) in zip(messages, spans):
        p = PINNED if (m["role"] == "system" or m.get("pinned")) else m.get("priority")
        if p is not None:
            pri[a:min(b, n)] = p
    return protected, pri


# A chunk is ~1e12 FLOPs: ~5 s of prefill on this 2-core CPU (~200 GFLOP/s), ~1 s on an 8-core laptop. Smaller
# chunks cost TTFT: a 4,096-token prompt of a Gemma-3-1B shape took x1.39 of one forward in 128-token chunks
# (every chunk attends through an explicit mask); 512-token chunks keep Stop within seconds.
CHUNK_FLOPS_CPU = 1.2e12
CHUNK_FLOPS_GPU = 2e13  # the same wait on a consumer GPU
MIN_CHUNK, MAX_CHUNK = 64, 2048


def prefill_chunk(num_params: int, device_type: str) -> int:
    """Tokens per prefill forward, so that Stop acts within about a second or two: ~2 FLOPs per parameter per
    token, rounded down to a power of two in 64..2048. A fixed number per model and device, so chunking
    never depends on timing (and a prompt that fits one chunk is prefilled exactly as HF does)."""
    budget = CHUNK_FLOPS_CPU if device_type == "cpu" else CHUNK_FLOPS_GPU
    tokens = budget / max(1, 2 * num_params)
    chunk = MIN_CHUNK
    while chunk * 2 <= min(tokens, MAX_CHUNK):
        chunk *= 2
    return chunk


def check_fits(prompt: int, max_new: int, ctx: int) -> str:
    """``ContextOverflowError`` (with what to change) when not even one token fits after the prompt; else a note
    when the reply may reach the context's end (it then stops there, stop reason ``context_full``), or "".
    A chat app's second turn on a 512-token model must not be refused because max new tokens says 256."""
    if prompt >= ctx:
        raise ContextOverflowError(f"the prompt has {prompt} tokens but the model's context is {ctx}: "
                                   "shorten the chat, start a new one, or choose an overflow policy")
    if prompt + max_new > ctx:
        return (f"the context of {ctx} tokens leaves room for {ctx - prompt} new tokens after this {prompt}-token "
                f"prompt (max new tokens {max_new}): the reply stops when the context is full; start a new chat or "
                "choose an overflow policy to go on")
    return ""