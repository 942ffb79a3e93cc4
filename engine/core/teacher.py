"""Teacher forcing: a text fed through a session's cache one token at a time, evicting and quantizing exactly as
during a reply, with the logits after each token (quality scoring, ``engine.tools.quality``; tests against HF)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence as Seq

import torch

from engine.errors import EngineError, as_engine_error

if TYPE_CHECKING:
    from engine.core.session import ChatSession


def teacher_force(session: "ChatSession", ids: Seq[int], prefill: int = 0) -> Iterator[torch.Tensor]:
    """Feed ``ids`` through ``session``'s cache and yield, after each token, the logits [vocab] predicting the
    next one. Starts a new text. The first ``prefill`` tokens go in as a prompt does (in chunks), with one yield
    after them. A failure rolls the forward back and is raised typed; the session stays usable."""
    session.check_open()
    if session.generating:
        raise EngineError("a reply is in progress: teacher forcing needs an idle session")
    session.reset()
    ids, q, c = [int(t) for t in ids], session.sequence, session.cache
    for group in ([ids[:prefill]] if prefill > 0 else []) + [[t] for t in ids[max(prefill, 0):]]:
        q.ids.extend(group)
        fed = False
        while not fed:
            try:
                work, cx = c.next_forward(q.ids, q.protected, q.priorities, session.prefill_chunk, q.turn)
                try:
                    (out,) = session.lm.runner.run([work])
                except BaseException:
                    if c.store is not None:
                        c.rollback()
                    raise
                fed = c.forward_done(work, out, cx, q.ids)
            except BaseException as e:
                raise as_engine_error(e) from e
        yield out.logits
