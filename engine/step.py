"""The one step implementation of a ``ChatSession`` (``Stepping``, its base): ``prepare`` plans and reserves the
next forward (a ``Work`` for ``engine.runner.ModelRunner``), ``finish`` commits it and takes the token — its
stop checks, its snapshot — or ``abort`` rolls it back. ``step()`` is the three for one session; the engine
core (``engine.scheduler``) runs them with several sessions' work in one forward.

What a step reads and writes is the session's: its ``Sequence`` (``engine.sequence``) and its ``SeqCache``
(``engine.seq_cache``), the one writer of the cache.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.errors import ContextOverflowError, EngineError, as_engine_error
from engine.runner import Output, Work
from engine.snapshot import StepResult

if TYPE_CHECKING:
    from engine.loader import LoadedModel
    from engine.seq_cache import SeqCache
    from engine.sequence import Sequence


class Stepping:
    """Stepping a reply; the session provides its parts (declared here) and ``check_open`` / ``snapshot``."""

    lm: "LoadedModel"
    sequence: "Sequence"
    cache: "SeqCache"
    prefill_chunk: int
    _open: tuple | None  # the prepared forward: (t0, tokens in the step, its Work, eviction context)

    def step(self) -> StepResult:
        """One model forward: a chunk of a long prefill (``event`` None), or the forward that gives a token."""
        work = self.prepare()
        if isinstance(work, StepResult):
            return work
        try:
            (out,) = self.lm.runner.run([work])
        except BaseException as e:
            raise self.abort(e) from e
        return self.finish(out)

    def pending_tokens(self) -> int:
        """Tokens the reply's next forwards still have to feed before its next token (1 while decoding)."""
        return self.cache.pending(len(self.seq)) if self.generating else 1

    def shares(self) -> int:
        """Tokens the next step would feed in a forward shared with other sessions (one decode token, or a prefill
        of more); 0 when it cannot share one (cancelled, cache off or swapped, a score-reading policy)."""
        ok = self.generating and not self.sequence.reply.cancel and self.cache.can_share(len(self.seq))
        return self.cache.pending(len(self.seq)) if ok else 0

    def prepare(self) -> Work | StepResult:
        """Plan and reserve the next forward: its ``Work``, or the reply's last ``StepResult`` when it ends without
        one (cancelled, context full). A typed error ends the reply (nothing reserved)."""
        self.check_open()
        if not self.generating:
            raise EngineError("no reply in progress: call start() first")
        q, c = self.sequence, self.cache
        if q.reply.cancel:
            return self._finish("cancelled", None)
        t0 = time.perf_counter()
        if q.reply.waited_ms < 0:  # the first forward: what came before it was waiting, not the model's work
            q.reply.waited_ms = (t0 - q.reply.t_start) * 1000.0
        c.evictions = []
        n_in = c.pending(len(q.ids))
        try:
            work, cx = c.next_forward(q.ids, q.protected, q.priorities, self.prefill_chunk, q.turn)
        except ContextOverflowError as e:
            q.add_notes([str(e)])
            return self._finish("context_full", None)
        except BaseException as e:
            raise self._fail(e) from e
        q.add_notes(cx.notes if cx is not None else ())
        self._open = (t0, n_in, work, cx)
        return work

    def abort(self, exc: BaseException) -> BaseException:
        """The prepared forward failed: roll it back, end the reply; the typed error to report."""
        if self._open is not None and self.cache.store is not None:
            self.cache.rollback()
        return self._fail(exc)

    def finish(self, out: Output, written: tuple[int, ...] = ()) -> StepResult:
        """After the prepared forward (``out``; ``written``: pages a batched forward wrote in this pool): commit,
        then the prefill chunk's progress, or the token, its stop checks and the snapshot."""
        (t0, n_in, work, cx), self._open = self._open, None
        q, c, t = self.sequence, self.cache, self.sequence.reply
        try:
            fed = c.forward_done(work, out, cx, q.ids, written)
            q.add_notes(cx.notes if cx is not None else ())
            if not fed:  # a chunk of a longer prefill: Stop can act before the next
                ms = (time.perf_counter() - t0) * 1000.0
                t.prefill_ms += ms
                return StepResult(event=None, snapshot=self.snapshot("prefill", ms), done=False, text=t.decoder.text)
            ctx_ids = torch.tensor(q.ids, dtype=torch.long) if t.sampling.repetition_penalty != 1.0 else None
            token = t.sampler(out.logits, ctx_ids)
        except BaseException as e:
            raise self._fail(e) from e
        event, stop = q.accept(token, t0, n_in, out.path, self.lm.stop_ids)
        stop = stop or ("context_full" if c.fills_context(len(q.ids)) else "")
        if stop:
            return self._finish(stop, event)
        return StepResult(event=event, snapshot=self.snapshot(event.phase, event.step_ms), done=False,
                          text=t.decoder.text)

    def _fail(self, exc: BaseException) -> BaseException:
        """End the turn after ``exc`` (its forward rolled back): the typed error."""
        self._open = None
        self.sequence.end("error")
        return as_engine_error(exc)

    def _finish(self, reason: str, event) -> StepResult:
        self._open = None
        event, stats = self.sequence.end_reply(reason, event)
        snapshot = self.snapshot(event.phase if event is not None else "decode", event.step_ms if event else 0.0)
        self.cache.written, self.cache.batch_size = (), 1  # an idle chat's picture shows no page being written
        return StepResult(event=event, snapshot=snapshot, done=True, stop_reason=reason, text=self.sequence.text,
                          stats=stats, warnings=self.sequence.take_notes())

