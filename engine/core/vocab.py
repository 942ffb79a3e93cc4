"""The engine's typed vocabulary: what a request is doing, which runs first, why a reply ended, which path ran a
forward, where a failure happened. Every surface (the app, the OpenAI server, ``engine attach``, the CLI) reads
these values and puts them into its own words; none of them parses engine text.

The string-valued enums compare equal to their values (``FinishReason.EOS == "eos"``) and serialise as them
(JSON, SQLite), so records written before they existed read back unchanged.
"""

from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` and format are its value (Python 3.11's ``enum.StrEnum``, on 3.10 too)."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def parse(cls, value: object, default: "StrEnum | None" = None):
        """``value`` as a member (a member, or its string), else ``default`` (``ValueError`` without one)."""
        try:
            return cls(value)
        except ValueError:
            if default is None:
                raise
            return default


class RequestStatus(enum.Enum):
    """The one lifecycle of a request — a chat's reply or an API request's alike — held by the reply's record
    (``engine.core.sequence.TurnState.status``), so the conversation and the engine core's ``Request`` read the
    same value. Every change goes through ``to``, which refuses a move the lifecycle does not have::

        WAITING -> RUNNING <-> PREEMPTED        a reply starts waiting; the core runs it, may preempt it
            \--------\-----------\--> FINISHED  it ends (its stop, an error, cancelled, its owner gave it up)

    Writers: the reply starts (``Sequence.begin``: WAITING) and ends itself (``Sequence.end``: FINISHED); the core
    schedules (RUNNING), preempts (PREEMPTED) and finishes what its owner gave up (``EngineCore.finish``)."""

    WAITING = "waiting"  # its reply started, not stepped by a core yet (or held by its source)
    RUNNING = "running"
    PREEMPTED = "preempted"  # its cache was given up for a request that came first: recomputed on its next step
    FINISHED = "finished"

    def to(self, new: "RequestStatus") -> "RequestStatus":
        """``new``, where the lifecycle moves from here to there (staying is always allowed); else ``ValueError``."""
        if new is not self and new not in _MOVES[self]:
            raise ValueError(f"a request cannot go from {self.value} to {new.value}")
        return new


_MOVES = {RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.FINISHED}),
          RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED, RequestStatus.FINISHED}),
          RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED}),
          RequestStatus.FINISHED: frozenset()}


class Priority(enum.IntEnum):
    """Which request the engine core runs first (lower first) and which one gives its pages up last."""

    FOREGROUND = 0  # the chat the user is looking at
    API = 1  # requests to the OpenAI server
    BACKGROUND = 2  # other chats' replies, comparisons


class FinishReason(StrEnum):
    """Why a reply ended: one vocabulary for the engine, the server's ``finish_reason``, the app and remote chats."""

    EOS = "eos"  # the model's end-of-sequence token
    STOP_STRING = "stop_string"  # a stop string the request gave
    MAX_TOKENS = "max_tokens"
    CONTEXT_FULL = "context_full"
    BUDGET_FULL = "budget_full"  # a policy's budget held nothing more it could evict
    CANCELLED = "cancelled"
    ERROR = "error"
    DONE = "done"  # ended without saying why (a remote server that sent no finish_reason)

    @property
    def openai(self) -> str:
        """The OpenAI API's ``finish_reason`` for it."""
        return _OPENAI.get(self, "stop")

    @classmethod
    def from_openai(cls, finish_reason: str | None) -> "FinishReason":
        """A server's ``finish_reason`` in our words (``None``: it sent none)."""
        return _FROM_OPENAI.get(finish_reason, cls.DONE)


_OPENAI = {FinishReason.EOS: "stop", FinishReason.STOP_STRING: "stop", FinishReason.MAX_TOKENS: "length",
           FinishReason.CONTEXT_FULL: "length", FinishReason.BUDGET_FULL: "length",
           FinishReason.CANCELLED: "cancelled", FinishReason.ERROR: "error"}
_FROM_OPENAI = {"stop": FinishReason.EOS, "length": FinishReason.MAX_TOKENS, "abort": FinishReason.CANCELLED,
                "cancelled": FinishReason.CANCELLED, "error": FinishReason.ERROR}


class StepPath(StrEnum):
    """What ran a forward (``ModelRunner`` chooses)."""

    OFF = "off"  # cache off: the whole text again
    EAGER = "eager"
    SCORES = "scores"  # eager, reading attention scores for a policy
    COMPILED = "compiled"
    BATCHED = "batched"  # one forward for several sequences
    COMPILED_BATCH = "compiled batch"  # several sequences' one token each through the compiled batched step
    SPECULATIVE = "speculative"  # a verification of drafted tokens


class FailureStage(StrEnum):
    """Where an operation failed; a failure at a reply stage ends that reply, the others leave the chat as it was."""

    LOAD = "load"
    START = "start"
    SWAP = "swap"
    STEP = "step"
    APPLY = "apply"
    SPECULATE = "speculate"
    COMPARE = "compare"
    HISTORY = "history"  # the app's chat history file (damaged, read-only, gone)


REPLY_STAGES = frozenset({FailureStage.START, FailureStage.SWAP, FailureStage.STEP})


class NoteKind(StrEnum):
    """What a note says; its fields (``Note.fields``) carry the values, so a surface can say it in its words."""

    TEXT = "text"  # said as written
    CACHE_SWITCH = "cache_switch"  # old, new (CacheConfig), rest: what the move cost
    CACHE_OFF = "cache_off"  # tokens recomputed every step
    POLICY_ON = "policy_on"  # policy (name), params (dict)
    POLICY_EVICTED = "policy_evicted"  # policy, params, tokens
    POLICY_SAYS = "policy_says"  # policy (name), rest: what the policy reports
    INT8_KEYS = "int8_keys"  # layout ("channel" | "token"), head_dim, page_size, rest
    DISK_RESTORED = "disk_restored"  # tokens, ms (reading them), again_ms (computing them, at the measured rate)


class Note(str):
    """A note from the engine: its words for logs, the CLI and the API (the string itself), and what it is
    (``kind``, ``fields``) for a surface that says it in its own words — the app renders by kind, never by
    reading the text back. A plain ``str`` where a note is expected is a ``NoteKind.TEXT`` note."""

    kind: NoteKind
    fields: dict

    def __new__(cls, text: str, kind: NoteKind = NoteKind.TEXT, **fields) -> "Note":
        note = super().__new__(cls, text)
        note.kind, note.fields = NoteKind(kind), fields
        return note

    def __reduce__(self):  # pickled (a process pool, a copy) with its kind and fields
        return (_note, (str(self), self.kind.value, self.fields))


def _note(text: str, kind: str, fields: dict) -> Note:
    return Note(text, NoteKind(kind), **fields)
