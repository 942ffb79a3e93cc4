"""The forwards of a round: which requests share one (``units``: a batchable group at its first member's turn, every
other one alone; ``batchable``), and ``run_forward``, the one place scheduled work reaches the model runner —
each session prepared with the tokens the scheduler granted it, one runner call, each finished. The engine core
(``engine.core.scheduler``) forms them from the demands it asked once a round; ``step_all`` steps sessions
without a core (tests, tools) through the same two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine.core.records import Demand
from engine.snapshot import StepResult

if TYPE_CHECKING:  # no torch here: the core imports this before torch loads
    from engine.model.runner import Output

MAX_BATCH = 16  # sequences per batched forward: past this the attention loop, not the weights, dominates a step


def batchable(sessions: Sequence) -> list[list]:
    """The groups of ``sessions`` that would share a forward now (``_groups``), each asked for its ``demand``."""
    return _groups(list(sessions), [s.demand() for s in sessions])


def forwards(sessions: Sequence) -> list[list]:
    """``sessions`` (in priority order) as the forwards they run in, in order (``units``)."""
    return units(list(sessions), [s.demand() for s in sessions])


def _groups(items: list, demands: list[Demand]) -> list[list]:
    """The groups of ``items`` (sessions, or a round's ``Scheduled``) that would share a forward now, one per model
    runner: every one decoding one token, plus the first (the highest-priority) one with a prefill chunk to feed,
    as vLLM's chunked prefill mixes them; at least one decode and two members a group, at most ``MAX_BATCH``.
    ``demands``: each item's ``Demand``, in order."""
    groups: dict[int, tuple[list, list]] = {}
    for x, d in zip(items, demands):
        if d.shares and not d.runner.batch_refusal():
            decodes, prefills = groups.setdefault(id(d.runner), ([], []))
            (decodes if d.shares == 1 else prefills).append(x)
    order = {id(x): i for i, x in enumerate(items)}
    out = []
    for decodes, prefills in groups.values():
        group = prefills[:1] + decodes if decodes else []
        if len(group) > 1:
            out.append(sorted(group[:MAX_BATCH], key=lambda x: order[id(x)]))
    return out


def units(items: list, demands: list[Demand]) -> list[list]:
    """``items`` (in priority order; ``demands``: each one's ``Demand``) as the forwards they run in, in order: a
    batchable group when its first member's turn comes (``_groups``), every other one alone."""
    group_of = {id(x): g for g in _groups(items, demands) for x in g}
    out, seen = [], set()
    for x in items:
        if id(x) in seen:
            continue
        unit = group_of.get(id(x), [x])
        seen.update(id(y) for y in unit)
        out.append(unit)
    return out


def step_all(sessions: Sequence, before: Callable[[Any], None] | None = None) -> list[Any]:
    """Step every generating session once, in the given order (the core passes them by priority): those whose
    next step is one token on a plain store decode together in one forward (``forwards``), the rest alone. Each
    gets its ``StepResult`` or the exception that ended its reply; a failed forward ends every reply it carried,
    each rolled back. ``before(session)``, if given, runs before each session is prepared (room for it)."""
    def room(s: Any, tokens: int | None) -> int | None:
        before(s)
        return tokens

    results: dict[int, Any] = {}
    for unit in forwards(sessions):
        results.update(run_forward([(s, None) for s in unit], room if before is not None else None))
    return [results[id(s)] for s in sessions]


def run_forward(unit: list[tuple[Any, int | None]], room: Callable[[Any, Any], Any] | None = None) -> dict[int, Any]:
    """One forward of ``unit`` (one session, or a batchable group, each with the tokens granted it: None, its own
    demand's): each prepared (room first: ``room(session, tokens)`` gives the grant it runs with), one runner call
    for those that need the model, then each one's own finish — a ``StepResult`` or the exception that ended its
    reply, by ``id(session)``. The only place scheduled work reaches the model runner."""
    out: dict[int, Any] = {}
    joined, works = [], []
    for s, tokens in unit:
        try:
            if room is not None:
                tokens = room(s, tokens)
            w = s.prepare(tokens)
        except BaseException as e:  # noqa: BLE001 - typed by the session, which ended the reply
            out[id(s)] = e
            continue
        if isinstance(w, StepResult):
            out[id(s)] = w
        else:
            joined.append(s)
            works.append(w)
    if not joined:
        return out
    try:
        outs: list["Output"] = joined[0].runner.run(works)
    except BaseException as e:  # noqa: BLE001 - every session of the forward ends with it
        for s in joined:
            typed = s.abort(e)
            if typed is not e and typed.__cause__ is None:
                typed.__cause__ = e  # the original, for KVSCOPE_DEBUG's traceback
            out[id(s)] = typed
        return out
    written = _written_together(joined, works, outs) if len(joined) > 1 else {}
    for s, o in zip(joined, outs):
        try:
            out[id(s)] = s.finish(o, written.get(s.pool_key(), ()))
        except BaseException as e:  # noqa: BLE001 - this session's reply ended, typed
            out[id(s)] = e
    return out


def _written_together(sessions: list, works: list, outs: list["Output"]) -> dict[int | None, tuple[int, ...]]:
    """Each pool's pages a batched forward wrote (every session's snapshot shows them all)."""
    by_pool: dict[int | None, set[int]] = {}
    for s, w, o in zip(sessions, works, outs):
        if o.path in ("batched", "compiled batch"):
            pages = s.pages_for(w)
            if pages is not None:
                by_pool.setdefault(pages[0], set()).update(pages[1])
    return {k: tuple(sorted(v)) for k, v in by_pool.items()}
