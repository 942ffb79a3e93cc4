"""Fidelity on the user's own chat: what a cache setting costs in quality, token by token, on this text.

The chat's tokens are teacher-forced through a full-precision keep-everything cache (the reference) and through
each setting (``engine.core.teacher.teacher_force_chunks``: every scored token sees the cache as decoding it would,
in few forwards; the history before the scored range is read as a prefill reads it), and compared where it
matters — the last turn (from the last user message) or the whole chat:

- per token, the KL divergence KL(reference || setting) of the next-token distributions (nats), and whether
  both pick the same most likely token (top-1 agreement);
- the perplexity of the chat's own next tokens under each, and their ratio;
- KV bytes held at the end per token of the chat (the Pareto front's x: bytes per token against fidelity).

``FidelityCheck`` runs as steps — one model forward per ``step()`` — so the app's worker submits it to its engine
core as a background task (``engine.core.scheduler.Task``, as Compare runs) and the window never waits; ``cancel``
stops it between two forwards. A lossless setting gives the reference's logits bit for bit (KL exactly 0).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from engine.config import CacheConfig

BIG_REFERENCE = 512 << 20  # bytes: a longer reference is kept as float16 log-probabilities (both sides rounded alike)
WORST = 10  # tokens named as the worst


@dataclass(frozen=True)
class FidelityRow:
    """One setting against the reference, over the scored tokens."""

    label: str
    config: CacheConfig
    tokens: int  # scored tokens
    mean_kl: float = 0.0  # nats a token
    max_kl: float = 0.0
    top1_agreement: float = 1.0
    perplexity: float = 0.0
    perplexity_ratio: float = 1.0  # against the reference's perplexity on the same tokens
    kv_bytes: int = 0  # held at the end
    bytes_per_token: float = 0.0  # kv_bytes / the chat's tokens
    seconds: float = 0.0
    error: str = ""  # why this setting could not run (the other rows still do)
    kl: tuple[float, ...] = ()  # per scored token (for the transcript's worst tokens)
    agree: tuple[bool, ...] = ()

    def as_dict(self, per_token: bool = False) -> dict[str, Any]:
        cfg = self.config
        out = {"label": self.label, "k_dtype": cfg.k_dtype, "v_dtype": cfg.v_dtype, "policy": cfg.policy,
               "params": dict(cfg.policy_params), "mode": cfg.mode, "page_size": cfg.page_size,
               "tokens": self.tokens, "mean_kl": self.mean_kl, "max_kl": self.max_kl,
               "top1_agreement": self.top1_agreement, "perplexity": self.perplexity,
               "perplexity_ratio": self.perplexity_ratio, "kv_bytes": self.kv_bytes,
               "bytes_per_token": self.bytes_per_token, "seconds": self.seconds, "error": self.error}
        if per_token:
            out["kl"], out["agree"] = list(self.kl), list(self.agree)
        return out


@dataclass(frozen=True)
class ChatText:
    """What is scored: the token ids, the scored range ``[start, end)`` (tokens predicted), where each message's
    tokens lie, and what the messages protect (as the chat's policy sees them)."""

    ids: tuple[int, ...]
    start: int
    end: int
    spans: tuple[tuple[int, int], ...] = ()  # per message: its tokens [a, b) in ``ids``
    protected: int = 0
    priorities: Any = None
    dropped: int = 0  # leading tokens of the chat left out to fit the context

    @property
    def scored(self) -> int:
        return self.end - self.start


def reference_config(cfg: CacheConfig) -> CacheConfig:
    """The full-precision keep-everything cache the settings are compared with (the setting's page size)."""
    return CacheConfig(mode="paged", page_size=cfg.page_size if cfg.mode == "paged" else 16, prefix_reuse=False)


def chat_text(lm, messages: Sequence[dict] | None = None, text: str | None = None,
              scope: str = "last-turn") -> ChatText:
    """The ids of a chat (its template, as a reply to it would be read) or a plain text, and what to score: from the
    last user message's first token (``scope`` "last-turn") or from the second token ("chat"). A chat longer than
    the model's context loses its oldest tokens (``dropped``): the reference must hold all it reads."""
    from engine.core.sequence import protection
    from engine.model.chat import message_spans, render_chat

    if scope not in ("last-turn", "chat"):
        raise ValueError(f"scope: {scope!r} is not one of last-turn, chat")
    tok = lm.tokenizer
    if tok is None:
        raise ValueError("fidelity needs a model with a tokenizer")
    if messages is not None:
        ids = [int(t) for t in render_chat(tok, messages, for_reply=False)]
        spans = [tuple(s) for s in message_spans(tok, messages)]
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
        first = spans[last_user][0] if spans and scope == "last-turn" else 1
    else:
        ids, spans, first = [int(t) for t in tok(text)["input_ids"]], [], 1
    room = lm.info.context_length - 1
    dropped = max(0, len(ids) - room)
    ids = ids[dropped:]
    spans = [(a - dropped, b - dropped) for a, b in spans]
    if len(ids) < 2:
        raise ValueError(f"the chat has {len(ids)} token{'s' if len(ids) != 1 else ''}: nothing to score")
    protected, priorities = protection(list(messages) if messages else None, [(max(a, 0), max(b, 0)) for a, b in spans],
                                       len(ids))
    return ChatText(tuple(ids), max(1, first - dropped), len(ids), tuple(spans), protected if not dropped else 0,
                    priorities, dropped)


def grid_settings(cfg: CacheConfig, n_tokens: int) -> list[tuple[str, CacheConfig]]:
    """Every K/V precision (K and V alike, ``engine.config.KV_DTYPES``) × keep everything and every listed eviction
    policy at half the chat's tokens: the user's own Pareto front."""
    from engine import config
    from engine.policies import registry

    page = cfg.page_size if cfg.mode == "paged" else 16
    out = []
    for kind in config.KV_DTYPES:
        for name in ("none", *registry):
            params = half_budget(name, n_tokens) if name != "none" else {}
            if params is None:
                continue
            c = CacheConfig(mode="paged", page_size=page, k_dtype=kind, v_dtype=kind, policy=name, policy_params=params)
            out.append((describe(c), c))
    return out


def half_budget(name: str, n_tokens: int) -> dict | None:
    """Parameters of policy ``name`` keeping about half of ``n_tokens`` (None: it cannot, at this length)."""
    from engine.policies import get_policy, get_policy_class

    cls = get_policy_class(name)
    fields = {f.name: f.default for f in dataclasses.fields(cls.Params)}
    half = max(8, n_tokens // 2)
    params: dict = {}
    if "budget" in fields:
        params["budget"] = half
        if "recent" in fields:
            params["recent"] = max(1, min(fields["recent"], half // 4))
    elif "window" in fields:  # StreamingLLM: sinks + window
        params["window"] = max(1, half - fields.get("sinks", 0))
    try:
        get_policy(name, params)
    except ValueError:
        return None
    return params


def describe(cfg: CacheConfig) -> str:
    """'int4 · h2o 128' — a short label for a plot's point and a table's row."""
    kv = cfg.k_dtype if cfg.k_dtype == cfg.v_dtype else f"K {cfg.k_dtype} V {cfg.v_dtype}"
    kv = "full precision" if kv == "auto" else kv
    if cfg.policy == "none":
        return kv
    p = cfg.policy_params
    keep = p.get("budget") or (p.get("sinks", 4) + p.get("window", 0))
    return f"{kv} · {cfg.policy} {keep}"


@dataclass
class _Run:
    """The setting in flight: its session, its teacher-forcing generator and what it has measured so far."""

    label: str
    config: CacheConfig
    session: Any
    forwards: Any
    t0: float
    kl: list = field(default_factory=list)
    agree: list = field(default_factory=list)
    nll: list = field(default_factory=list)
    fed: int = 0


class FidelityCheck:
    """The chat teacher-forced through the reference, then each setting, one forward per ``step()`` (a background
    task of an engine core). ``step()`` returns the finished setting's ``FidelityRow`` (the reference's first, its
    ``mean_kl`` 0), else None; ``done`` once every setting ran or ``cancel()`` took effect. A setting that fails
    with an engine error gives a row with ``error`` and the check goes on (the reference failing ends it). ``close()``
    frees the session in flight (idempotent)."""

    def __init__(self, lm, chat: ChatText, settings: Sequence[tuple[str, CacheConfig]],
                 reference: CacheConfig | None = None) -> None:
        self.lm, self.chat = lm, chat
        ref = reference or reference_config(settings[0][1] if settings else CacheConfig())
        self.settings = [("reference", ref), *settings]
        self.rows: list[FidelityRow] = []
        self._next = 0
        self._run: _Run | None = None
        self._stopped = False
        self._ref: tuple | None = None  # (log-probs [S, V], top-1 [S], mean nll) over the scored positions
        self._ref_parts: list = []  # the reference's log-probs, forward by forward, until it finished
        self._t0 = time.perf_counter()

    @property
    def cancelled(self) -> bool:
        return self._stopped

    @property
    def done(self) -> bool:
        return self._run is None and (self._stopped or self._next >= len(self.settings))

    def cancel(self) -> None:
        """Stop after the current forward; the rows so far stay."""
        self._stopped = True
        self.close()

    def close(self) -> None:
        self._stopped = self._stopped or self._next < len(self.settings) or self._run is not None
        run, self._run = self._run, None
        if run is not None:
            run.forwards.close()
            run.session.close()

    def step(self) -> FidelityRow | None:
        """One forward of the setting in flight (opening the next one first); its row when it finished."""
        from engine.errors import EngineError

        if self.done:
            return None
        try:
            if self._run is None:
                self._open()
            run = self._run
            try:
                first, logits = next(run.forwards)
            except StopIteration:
                return self._finish(run, "")
            except (EngineError, ValueError) as e:
                return self._finish(run, str(e))
            self._take(run, first, logits)
            if run.fed >= len(self.chat.ids):
                return self._finish(run, "")
            return None
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        from engine.core.session import ChatSession
        from engine.core.teacher import teacher_force_chunks

        label, cfg = self.settings[self._next]
        self._next += 1
        session = ChatSession(self.lm, cfg.replace(prefix_reuse=False))
        c = self.chat
        # the scored tokens see the cache as decoding them would; the history before them is read as a prefill
        # reads it (as the chat's prompts were, and as a reopened chat reads it again)
        forwards = teacher_force_chunks(session, c.ids, c.protected, c.priorities, exact_from=c.start - 1)
        self._run = _Run(label, cfg, session, forwards, time.perf_counter())

    def _take(self, run: _Run, first: int, logits) -> None:
        """The forward's logits [q, V] at positions ``first..``: those predicting a scored token, compared."""
        import torch

        c = self.chat
        run.fed = first + logits.shape[0]
        a, b = max(first, c.start - 1), min(run.fed, c.end - 1)  # positions p predicting token p + 1 in [start, end)
        if a >= b:
            return
        lp = torch.log_softmax(logits[a - first:b - first].float(), dim=-1)  # [m, V]
        target = torch.tensor(c.ids[a + 1:b + 1], device=lp.device)
        if self._ref is None:  # the reference: kept over the scored positions
            big = c.scored * lp.shape[1] * 4 > BIG_REFERENCE
            lp = lp.half().float() if big else lp
            self._ref_parts.append((lp.half() if big else lp).cpu())
            run.nll.extend((-lp.gather(1, target[:, None])[:, 0]).tolist())
            run.kl.extend([0.0] * (b - a))
            run.agree.extend([True] * (b - a))
            return
        ref_lp, ref_top, _ = self._ref
        r = ref_lp[a - (c.start - 1):b - (c.start - 1)].to(lp.device).float()  # [m, V]
        if ref_lp.dtype == torch.float16:
            lp = lp.half().float()  # rounded as the reference was: a lossless setting still gives exactly 0
        kl = (r.exp() * (r - lp)).sum(-1).clamp_min(0.0)  # [m]
        run.kl.extend(kl.tolist())
        run.agree.extend((lp.argmax(-1).cpu() == ref_top[a - (c.start - 1):b - (c.start - 1)]).tolist())
        run.nll.extend((-lp.gather(1, target[:, None])[:, 0]).tolist())

    def _finish(self, run: _Run, error: str) -> FidelityRow:
        import torch

        self._run = None
        try:
            kv = int(run.session.snapshot().kv_bytes) if not error else 0
        finally:
            run.forwards.close()
            run.session.close()
        n = len(run.kl)
        secs = time.perf_counter() - run.t0
        if error or n == 0:
            row = FidelityRow(run.label, run.config, 0, error=error or "nothing was scored", seconds=secs)
            if self._ref is None:
                self._stopped = True  # without the reference nothing can be compared
        else:
            nll = float(np.mean(run.nll))
            if self._ref is None:
                ref_lp = torch.cat(self._ref_parts)
                self._ref, self._ref_parts = (ref_lp, ref_lp.float().argmax(-1), nll), []
            ref_nll = self._ref[2]
            kl = np.asarray(run.kl)
            row = FidelityRow(run.label, run.config, n, float(kl.mean()), float(kl.max()), float(np.mean(run.agree)),
                              math.exp(nll), math.exp(nll - ref_nll), kv, kv / max(1, len(self.chat.ids)), secs,
                              kl=tuple(float(x) for x in kl), agree=tuple(bool(x) for x in run.agree))
        self.rows.append(row)
        return row

    def progress(self) -> tuple[float, float | None, str]:
        """(fraction done, seconds left or None while unknown, what runs now)."""
        n = len(self.settings)
        run = self._run
        part = run.fed / max(1, len(self.chat.ids)) if run is not None else 0.0
        fraction = min(1.0, (len(self.rows) + part) / n)
        elapsed = time.perf_counter() - self._t0
        left = elapsed / fraction * (1 - fraction) if fraction > 0.02 else None
        label = run.label if run is not None else (self.settings[min(self._next, n - 1)][0] if n else "")
        return fraction, left, f"{label} ({min(len(self.rows) + 1, n)} of {n})"
