"""A request on its way through the engine (``Job``), and how far its reader is behind (``Backlog``).

A streamed reply's events wait in the job's queue until the HTTP side sends them; a client that stops reading
fills the socket buffers, then this queue. So the queue is bounded: past ``limit`` unsent events the request is
held (its core ``Request`` not stepped: no tokens, no compute, its pages kept), and taken up again once the
reader catches up to half of that; held for ``stall_s`` without catching up, it is cancelled (its pages and
running slot go back). Both are counted (``kvscope_streams_stalled_total{action="paused"|"cancelled"}``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable

from engine.server.schemas import GenRequest
from engine.server.stops import StopTrimmer

_job_ids = itertools.count(1)


@dataclass(frozen=True)
class JobRecord:
    """How a finished request used the engine (kept for tests, tools and the app)."""

    job_id: int
    request_id: str  # the response's id (chatcmpl-..., cmpl-...)
    session_id: int
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    completion_tokens: int
    finish_reason: str


class Backlog:
    """Events posted (engine thread) and taken (HTTP thread): each counter has one writer, so no lock."""

    def __init__(self, limit: int, stall_s: float) -> None:
        self.limit, self.stall_s = max(1, limit), stall_s
        self.posted = 0
        self.taken = 0
        self.held_since: float | None = None  # monotonic time the job was last held (engine thread)

    @property
    def pending(self) -> int:
        return self.posted - self.taken

    def hold(self) -> bool:
        """Engine thread, each round: hold past ``limit`` pending events, until the reader is within half."""
        if self.held_since is None and self.pending > self.limit:
            self.held_since = time.monotonic()
        elif self.held_since is not None and self.pending <= self.limit // 2:
            self.held_since = None
        return self.held_since is not None


class Job:
    """One request on its way through the engine. Events: ("start", info), ("delta", (text, logprob entry, token id)),
    ("done", info), ("error", ApiError); "start" or "error" comes first, "done" or "error" last."""

    def __init__(self, req: GenRequest, loop: asyncio.AbstractEventLoop, request_id: str = "",
                 tenant: bytes = b"", backlog: Backlog | None = None) -> None:
        self.id = next(_job_ids)
        self.request_id = request_id
        self.tenant = tenant  # who may share its cache (``engine.core.session_pool.SessionPool.take``)
        self.req = req
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.backlog = backlog or Backlog(1 << 30, 0.0)
        self.cancelled = False
        self.finished = False  # set by the engine thread after the last event
        self.session = None
        self.prepared = None  # engine.server.prompts.Prepared: its prompt's ids, made ready before it queued
        self.sampling = None  # SamplingConfig, once admitted
        self.stats = None  # TurnStats of start()
        self.own = False  # it goes on with a whole conversation of its session (``engine.server.account``)
        self.request = None  # its request on the engine core, once admitted
        self.trim = StopTrimmer(req.stop, req.include_stop_str_in_output)
        self.logprobs: list[dict] | None = [] if req.logprobs is not None else None  # one entry per token
        self.scheduler = None  # the Scheduler that runs it
        self.tools = None  # engine.server.tool_calls.ToolStream: the reply is read for tool calls (``read_tools``)
        self.tokenizer = None
        self.raw = None  # its text decoded with special tokens kept (markers such as [TOOL_CALLS] are special)
        self.stop_set: frozenset[int] = frozenset()
        self.content = ""  # what the client was sent as content, when the reply is read for calls
        self.on_taken: Callable[[], None] = lambda: None  # a held job's reader caught up: wake the engine

    def read_tools(self, fmt: str, specials: tuple[str, ...], tokenizer, stop_ids) -> None:
        """Read this reply for tool calls in ``fmt`` (``engine.server.tool_calls``; with transformers' response
        parsing where the tokenizer has a ``response_template``)."""
        from engine.model.chat import StreamDecoder
        from engine.server.tool_calls import ToolStream

        self.tools = ToolStream(fmt, specials)
        self.tokenizer = tokenizer
        self.raw = StreamDecoder(tokenizer, skip_special_tokens=False)
        ends = ([] if self.req.ignore_eos else list(stop_ids)) + list(self.req.stop_token_ids)
        self.stop_set = frozenset(ends)

    def text_of(self, token: int, plain_delta: str, look: bool) -> str:
        """The text a token adds to the reply as the client sees it (stop sequences cut; tool calls kept out)."""
        if self.tools is None:
            return self.trim.push(plain_delta, look)
        raw = "" if token in self.stop_set else self.raw.push(token)
        out = self.tools.push(self.trim.push(raw, look))
        self.content += out
        return out

    def finish_text(self) -> tuple[str, list]:
        """(the text still to send, the tool calls read) at the reply's end."""
        if self.tools is None:
            return self.trim.finish(), []
        tail = self.tools.push(self.trim.push(self.raw.flush()) + self.trim.finish())
        rest, calls = self.tools.finish()
        if getattr(self.tokenizer, "response_template", None) is not None:
            from engine.server.tool_calls import transformers_calls

            prefix = self.tokenizer.decode(list(self.prepared.ids), skip_special_tokens=False)
            calls = transformers_calls(self.tokenizer, self.tools.text, prefix, self.req.tools) or calls
        self.content += tail + rest
        return tail + rest, calls

    @property
    def text(self) -> str:
        """The reply's text as the client got it."""
        return self.content if self.tools is not None else self.trim.text

    def post(self, kind: str, data: Any) -> None:
        self.backlog.posted += 1
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    async def next(self) -> tuple[str, Any]:
        event = await self.events.get()
        self.backlog.taken += 1
        b = self.backlog
        if b.held_since is not None and b.pending <= b.limit // 2:
            self.on_taken()
        return event

    def cancel(self) -> None:
        """Stop this request (from any thread): between two steps its session is closed."""
        if not self.cancelled and not self.finished and self.scheduler is not None:
            self.cancelled = True
            self.scheduler.cancelled(self)
