"""A conversation apart from its cache: ``Sequence`` (its token ids, turn, status, the reply in progress and
its notes), one reply's sampling and timings (``TurnState``), which tokens are protected from eviction and at
what priority (``protection``), the shared prefix that prefix reuse keeps (``common_prefix``), and how many
tokens one prefill forward feeds (``prefill_chunk``).

The sequence's cache is ``engine.core.seq_cache.SeqCache``; ``engine.core.session.ChatSession`` joins the two.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import numpy as np
import torch

from engine.config import SamplingConfig
from engine.errors import ContextOverflowError
from engine.policies import PINNED
from engine.core.account import with_dropped
from engine.core.sampling import Sampler
from engine.snapshot import TokenEvent, TurnStats
from engine.core.token_ids import interned
from engine.core.verify import verify
from engine.core.vocab import RequestStatus
from engine.model.chunks import CHUNK_FLOPS_CPU, CHUNK_FLOPS_GPU, MAX_CHUNK, MIN_CHUNK, prefill_chunk  # noqa: F401


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
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
    """One reply's sampling, text and timings, and where it is in its lifecycle (``status``: the one status of the
    request, which the engine core's ``Request`` reads too; replaced at every ``start``)."""

    status: RequestStatus = RequestStatus.WAITING  # changed only through ``RequestStatus.to``
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sampler: Sampler | None = None
    decoder: Any = None
    generated: list[int] = field(default_factory=list)
    stop_from: int = 0  # characters of the text stop strings are not looked for in: the first min_new_tokens'
    step: int = 0
    t_start: float = 0.0
    prefill_ms: float = 0.0  # every chunk of the prefill and the forward that gave the first token
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    policy_prefill_ms: float = 0.0  # the eviction policy's own work (scoring, choosing) in the prefill's forwards
    policy_decode_ms: float = 0.0  # ... in the decode forwards
    prompt_len: int = 0
    reused: int = 0
    recomputed: int = 0  # prompt tokens computed (fed) in this reply
    dropped: int = 0  # prompt tokens passed over unread to fit the context: neither reused nor computed
    unread: list = field(default_factory=list)  # where planning passed over them: ``[start, end)`` each
    divergence: int = -1
    shared: int = 0  # reused tokens taken from the prefix cache (pages other sessions computed)
    disk: int = 0  # of them, tokens restored from the KV disk tier (``engine.kv.tier.disk``)
    disk_ms: float = 0.0  # reading them
    disk_again_ms: float = 0.0  # what computing them would take, at the model's measured prefill rate
    threads: int = 0
    waited_ms: float = -1.0  # waited before its first forward (other work, a compile): never TTFT; -1 not yet run
    forwards: int = 0  # forwards that gave tokens
    spec: Any = None  # ``engine.core.verify.SpecStats`` while the chat speculates
    spec_label: str = ""
    account: Any = None  # ``engine.snapshot.CacheAccount`` of its prompt (``SeqCache.reuse``)
    reprefills: list = field(default_factory=list)  # ``Reprefill``s: tokens cache changes had it read again

    @property
    def reprefill_ms(self) -> float:
        """Time spent reading tokens again after cache changes: never TTFT, prefill or decode time."""
        return sum(r.ms for r in self.reprefills)

    def stats(self, reason: str) -> TurnStats:
        n = len(self.generated)
        return TurnStats(
            prompt_tokens=self.prompt_len, reused_tokens=self.reused, recomputed_tokens=self.recomputed,
            dropped_tokens=self.dropped,
            first_divergence=self.divergence, generated_tokens=n, ttft_ms=self.ttft_ms,
            prefill_ms=self.prefill_ms, decode_ms=self.decode_ms,
            policy_prefill_ms=self.policy_prefill_ms, policy_decode_ms=self.policy_decode_ms,
            decode_tokens_per_s=(max(0, n - 1) / (self.decode_ms / 1000.0)) if self.decode_ms > 0 else 0.0,
            prefill_tokens_per_s=(self.recomputed / (self.prefill_ms / 1000.0)) if self.prefill_ms > 0 else 0.0,
            reprefilled_tokens=sum(r.done for r in self.reprefills), reprefill_ms=self.reprefill_ms,
            reprefills=tuple(self.reprefills),
            stop_reason=reason, shared_tokens=self.shared, threads=self.threads, forwards=self.forwards,
            disk_restored_tokens=self.disk, disk_ms=self.disk_ms, disk_again_ms=self.disk_again_ms,
            cache=self._account(),
            **self._spec_stats(),
        )

    def _account(self):
        """The prompt's cache account, with what planning dropped unread since (``planned``)."""
        a = self.account
        if a is None or a.dropped == self.dropped:
            return a
        return dataclasses.replace(a, recomputed=self.recomputed, dropped=self.dropped)

    def _spec_stats(self) -> dict:
        s = self.spec
        if s is None:
            return {}
        last = max((i + 1 for i, n in enumerate(s.tried_pos) if n), default=0)
        return dict(speculative=self.spec_label, draft_tokens=s.draft_tokens, accepted_draft_tokens=s.accepted,
                    verifications=s.drafts,
                    accepted_by_position=tuple(s.by_pos[:last]), spec_note=s.summary())


def protection(messages: Seq[dict] | None, spans: Seq[tuple[int, int]],
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

class Sequence:
    """One conversation's token ids (``ids``: every token so far, the reply's included), its turn, whether it is
    closed for good, its last or current reply (``reply``, whose ``status`` is the request's one lifecycle:
    replying while it is live) and the notes the user must see with it. One writer: the session (the engine core
    moves a reply's status between waiting, running and preempted, through ``RequestStatus.to``)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.turn = -1
        self.closed = False
        self.cancelled = False  # the reply in progress was asked to stop (``cancel``); its next step ends it
        self.generation_id = 0
        self.reply = TurnState(status=RequestStatus.FINISHED)  # no reply yet
        self.notes: list[str] = []  # for the user, handed out with the reply's last step
        self.protected = 0  # logical [0, protected): system prompt + first message
        self.priorities: np.ndarray | None = None  # [T] per logical position, -1: the policy's default
        self.last_stats: TurnStats | None = None

    def cancel(self) -> None:
        """Ask the reply in progress to stop at its next step (any thread: only a flag is set)."""
        self.cancelled = True

    def speculating(self, stats, label: str = "") -> None:
        """The reply's speculation counts from now on (``engine.core.verify.SpecStats``; None: it stopped)."""
        self.reply.spec = stats
        if stats is not None:
            self.reply.spec_label = label

    def generated(self) -> list[int]:
        """The reply's tokens so far (a copy)."""
        return list(self.reply.generated)

    @property
    def running(self) -> bool:
        """A reply is in progress (its request waiting, running or preempted)."""
        return self.reply.status is not RequestStatus.FINISHED

    def clear(self) -> None:
        """Forget the conversation (its ids and turn; a reply in progress is over); ready for a first reply again."""
        self.ids, self.turn = [], -1
        self.reply.status = self.reply.status.to(RequestStatus.FINISHED)

    def close(self) -> None:
        """Closed for good: a reply in progress ends ``cancelled``; no other starts."""
        if self.running:
            self.end("cancelled")
        self.closed = True

    def copy(self) -> "Sequence":
        """The conversation (ids, turn, protection) without a reply in progress (a fork)."""
        other = Sequence()
        other.ids, other.turn, other.protected = list(self.ids), self.turn, self.protected
        other.priorities = None if self.priorities is None else self.priorities.copy()
        return other

    def add_notes(self, notes: Seq[str]) -> None:
        self.notes += [n for n in notes if n not in self.notes]

    def planned(self, plan, t0: float) -> None:
        """A forward was planned (``plan``: its ``engine.core.eviction.EvictionPlan``, None with the cache off),
        prepared from ``t0`` on: the reply's first forward ends its wait (what came before it was waiting, not the
        model's work); its notes for the user, and prompt tokens it dropped unread, which move from "to compute" to
        "dropped" so the prefill rate counts only tokens the model read."""
        if self.reply.waited_ms < 0:
            self.reply.waited_ms = (t0 - self.reply.t_start) * 1000.0
        if plan is None:
            return
        self.add_notes(plan.all_notes)
        self.reply.recomputed -= plan.dropped
        self.reply.dropped += plan.dropped
        if plan.dropped and self.reply.account is not None:  # the account every surface shows says so too
            self.reply.unread += plan.runs
            self.reply.account = with_dropped(self.reply.account, self.reply.dropped, self.reply.unread)

    def forward_done(self, record) -> None:
        """A forward of the reply ran (``record``: its cache's ``engine.core.records.StepRecord``): the eviction
        policy's time to the prefill's or the decode's count, its evictions' notes for the user."""
        t = self.reply
        if t.generated:
            t.policy_decode_ms += record.policy_ms
        else:
            t.policy_prefill_ms += record.policy_ms
        self.add_notes([n for e in record.evictions for n in e.notes])

    def chunk_done(self, ms: float) -> None:
        """A chunk of the prompt's prefill took ``ms`` (its share of a cache change's re-prefill not counted)."""
        self.reply.prefill_ms += ms

    def next_token(self, logits, t0: float, n_in: int, path: str, stop_ids: Seq[int]) -> tuple[TokenEvent, str]:
        """The forward that read every token gave ``logits`` (``[vocab]``): the reply's sampler picks the next
        token (the chat's ids for its penalties), which is accepted (``accept``); one more forward that gave tokens."""
        t = self.reply
        ctx_ids = torch.tensor(self.ids, dtype=torch.long) if t.sampling.repetition_penalty != 1.0 else None
        out = self.accept(t.sampler(logits, ctx_ids), t0, n_in, path, stop_ids)
        t.forwards += 1
        return out

    def verified(self, logits, drafts: Seq[int]) -> list[int]:
        """The tokens a verification of ``drafts`` yields (``engine.core.verify.verify``, with the reply's sampler)."""
        return verify(self.reply.sampler, logits, drafts, self.ids)

    def verification_done(self, note: str) -> None:
        """A verification's tokens were accepted: one more forward that gave tokens; ``note``, if any, for the user."""
        self.reply.forwards += 1
        self.add_notes([note] if note else [])

    def draft_budget(self) -> int:
        """How many draft tokens the reply may verify after its next token (0: decode plainly): only while decoding,
        not cancelled, without log-probabilities (the sampler's of each token it picks: decoded one by one)."""
        t = self.reply
        if not t.generated or self.cancelled or t.sampling.logprobs is not None:
            return 0
        return t.sampling.max_new_tokens - len(t.generated) - 1

    def propose(self, spec, room: int) -> list[int]:
        """Up to ``room`` drafts from ``spec`` (``engine.core.verify.Speculator``), cut to what the reply's grammar
        takes."""
        sampler = self.reply.sampler
        return sampler.valid_drafts(spec.propose(self.ids, room, sampler))

    def take_notes(self) -> tuple[str, ...]:
        notes, self.notes = tuple(self.notes), []
        return notes

    def begin(self, ids: list[int], reply: TurnState, generation_id: int, messages: Seq[dict] | None,
              spans: Seq[tuple[int, int]]) -> None:
        """A new reply to ``ids`` (the whole prompt; the cache has been cut back to what it reuses)."""
        self.ids = list(ids)
        self.turn += 1
        self.protected, self.priorities = protection(messages, spans, len(ids))
        self.generation_id = generation_id
        if reply.status is not RequestStatus.WAITING:
            raise ValueError(f"a new reply starts waiting, not {reply.status.value}")
        self.reply, self.cancelled = reply, False

    def accept(self, token: int, t0: float, n_in: int, path: str, stop_ids: Seq[int]) -> tuple[TokenEvent, str]:
        """Append a sampled token; its event and the stop reason it causes ("" to go on; the context is checked
        by the caller, which knows the cache)."""
        token = interned(token)  # the lists below share one object per id (engine.core.token_ids)
        t = self.reply
        dt_ms = (time.perf_counter() - t0) * 1000.0
        phase = "prefill" if not t.generated else "decode"
        if phase == "prefill":
            t.prefill_ms += dt_ms
            waited = max(0.0, t.waited_ms) + t.reprefill_ms  # a wait, or a cache change's re-prefill: not TTFT
            t.ttft_ms = (time.perf_counter() - t.t_start) * 1000.0 - waited
        else:
            t.decode_ms += dt_ms
        index = len(t.generated)
        t.generated.append(token)
        self.ids.append(token)
        t.step += 1
        is_stop_token = (token in stop_ids and not t.sampling.ignore_eos) or token in t.sampling.stop_token_ids
        delta = "" if is_stop_token else t.decoder.push(token)
        before_min = len(t.generated) <= t.sampling.min_new_tokens
        if before_min:
            t.stop_from = len(t.decoder.text)  # vLLM's min_tokens: stop strings in this text do not count
        stop = ""
        if is_stop_token:
            stop = "eos"
        elif (not before_min and t.sampling.stop_strings
              and any(t.decoder.text.find(s, t.stop_from) >= 0 for s in t.sampling.stop_strings)):
            stop = "stop_string"
        elif len(t.generated) >= t.sampling.max_new_tokens:
            stop = "max_tokens"
        return TokenEvent(self.generation_id, index, token, delta, phase, dt_ms, n_in, path), stop

    @property
    def text(self) -> str:
        """The reply's text so far."""
        return self.reply.decoder.text if self.reply.decoder is not None else ""

    def end_reply(self, reason: str, event: TokenEvent | None) -> tuple[TokenEvent | None, TurnStats]:
        """The reply ends with ``reason``: text the decoder held back goes out with the last event (a stop token
        too: a byte-fallback run just before it, ``<0x7D>`` for "}", is text the reply wrote)."""
        d = self.reply.decoder
        tail = d.flush() if d is not None else ""
        if tail and event is not None:
            event = dataclasses.replace(event, text_delta=event.text_delta + tail)
        return event, self.end(reason)

    def end(self, reason: str) -> TurnStats:
        """The reply ends with ``reason``: its stats (kept as ``last_stats``)."""
        self.reply.status = self.reply.status.to(RequestStatus.FINISHED)
        self.cancelled = False
        self.last_stats = self.reply.stats(reason)
        return self.last_stats
