"""Teacher forcing: a text fed through a session's cache evicting and quantizing exactly as during a reply, with the
logits after each token: one token a forward (``teacher_force``: tests against HF), or in the largest forwards that
keep every token's view of the cache what decoding it alone would give (``teacher_force_chunks``: quality scoring,
``engine.tools.quality``, and the fidelity check, ``engine.tools.fidelity``)."""

from __future__ import annotations

import dataclasses

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


def exact_chunk(session: "ChatSession", todo: int) -> int:
    """Most of the ``todo`` unfed tokens one forward may feed so that each of them sees the cache exactly as it would
    decoding alone (one token a forward): not past a policy's budget (the evictor trims after the forward that
    reaches it, as it does after that token), not past the context, and on quantized pages not completing a page
    but with its last token (a forward writes, then reads: the tokens before the last would read their own page
    quantized where decoding reads it in full precision)."""
    c = session.cache
    chunk = max(1, min(todo, session.prefill_chunk))
    if c.store is None:
        return chunk
    n, policy, cfg = c.index.n, c.policy, c.cache_config
    if policy is not None:
        chunk = min(chunk, max(1, policy.budget - n))
    chunk = min(chunk, max(1, session.lm.info.context_length - c.index.next_rope))
    if cfg.quantized and cfg.mode == "paged":
        P = cfg.page_size
        off = n % P
        chunk = min(chunk, 1 if off == P - 1 else P - 1 - off)
    return chunk


def teacher_force_chunks(session: "ChatSession", ids: Seq[int], protected: int = 0,
                         priorities=None, start_over: bool = True,
                         exact_from: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """Feed ``ids`` through ``session``'s cache in forwards of ``exact_chunk`` tokens and yield, after each forward,
    ``(first, logits)``: ``logits[i]`` [vocab] is what the cache predicts after ``ids[first + i]``, as decoding one
    token at a time would (the same evictions at the same tokens, the same quantized pages read) but in about
    ``slack`` or ``page_size`` times fewer forwards (lossless caches: the prefill's chunks). ``protected`` /
    ``priorities``: what the chat's messages protect (``engine.core.sequence.protection``), as its policy sees
    them. ``exact_from``: positions before it are read as a prompt's prefill reads them (chunks of the prefill's
    size, quantized pages completed within a chunk read quantized by the chunk's own tokens; a policy's budget
    still bounds each chunk): the history of a chat whose last turn alone is scored. Starts a new text
    (``start_over=False``: goes on after the tokens fed before, ``ids`` the ones to add); a failure rolls the
    forward back and is raised typed; the session stays usable."""
    session.check_open()
    if session.generating:
        raise EngineError("a reply is in progress: teacher forcing needs an idle session")
    if start_over:
        session.reset()
    q, c = session.sequence, session.cache
    q.ids.extend(int(t) for t in ids)
    q.protected, q.priorities = protected, priorities
    fed = c.index.next_pos if c.store is not None and not start_over else 0
    while fed < len(q.ids):
        first = c.index.next_pos if c.store is not None else 0  # cache off: the whole text in one forward
        if c.store is None:
            upto = len(q.ids)
        elif first < exact_from:  # the history: as a prefill reads it, up to where decoding exactness starts
            upto = min(exact_from, first + session.prefill_chunk)
        else:
            upto = first + exact_chunk(session, len(q.ids) - first)
        try:
            work, cx = c.next_forward(q.ids[:upto], q.protected, q.priorities, session.prefill_chunk, q.turn)
            work = dataclasses.replace(work, all_logits=True)
            try:
                (out,) = session.lm.runner.run([work])
            except BaseException:
                if c.store is not None:
                    c.rollback()
                raise
            c.forward_done(work, out, cx, q.ids[:upto])
        except BaseException as e:
            raise as_engine_error(e) from e
        fed = first + work.q
        yield first, out.logits if out.logits.dim() == 2 else out.logits[None]  # [q, vocab]
