"""Speculative decoding: guess the next ``k`` tokens cheaply, check them with one forward of the model.

A drafter proposes ``d_1..d_k`` after the chat's last token ``x``; the runner feeds ``x, d_1..d_k`` in one
forward with logits at every position (``Work.all_logits``) over the sequence's own paged cache; ``verify``
keeps the drafts the model would have chosen itself and adds the model's own next token, so one forward gives
1..k+1 tokens. The cache wrote k + 1 slots; the rejected ones are cut back at once (``SeqCache.commit_verify``).

- Greedy: a draft stays while it is the argmax of the model's (penalised) logits at its position — the tokens
  are exactly those of decoding without speculation.
- Sampling: the model's token at each position is drawn as plain decoding draws it (the reply's generator, one
  draw per token it yields, in order), and a draft stays while it is that token. Both drafters here draft
  deterministically (q a point mass at d), and for such a q this is speculative rejection sampling (Leviathan et
  al. 2023, Chen et al. 2023) with the uniforms coupled to the draws: d stays with probability p(d) =
  min(1, p(d) / q(d)), and otherwise the token is p's draw given it is not d, i.e. the normalised residual
  max(0, p - q). The output distribution is p's, and a seed gives the tokens decoding without speculation
  gives, whatever was drafted, kept, or timed. A uniform per draft, then a draw from the residual, made the
  number of draws depend on k and on auto-off (wall-clock timing): the same seeded request to ``serve
  --speculative ngram`` gave its first text again 1 to 5 times in 5, depending on the seed. (Same draws, same
  tokens, as far as the logits agree: a (k+1)-token forward may round differently from a one-token one; in
  float32 on stories260K every seeded test reply matches plain decoding token for token.)

Drafters: ``NgramDrafter`` (prompt lookup: the chat's last n-gram found earlier in the chat; no second
model) and ``engine.speculation.draft_model.ModelDrafter`` (a smaller model with the same tokenizer, on its own cache).
``Speculator`` is one chat's speculation: its drafter, ``k`` (adapted to the acceptance as HF's heuristic
schedule does), and whether it pays (timed against plain decoding steps; off for the reply when it does not).
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.config import MAX_DRAFT, SPEC_METHODS, SpecConfig  # noqa: F401 - torch-free, for the GUI
from engine.core.sampling import Sampler

START_K = 4
# Auto-off: after this many verifications, speculation must beat plain decoding per token, or it stops for the
# reply. Plain steps are measured when a drafter has nothing to offer, or by a probe of PROBE_STEPS.
MIN_VERIFY, PROBE_STEPS, PAYS = 4, 2, 0.97
# A verdict of "slower" is kept per model and drafter (like the compiled step's timings): the next replies start
# without speculation, and every RETRY_EVERY-th reply tries again (what a chat asks changes what pays).
RETRY_EVERY = 4


@dataclass
class Verdict:
    """What speculation with one drafter measured on one model, last time it was judged."""

    pays: bool
    spec_ms: float  # per token, speculating
    plain_ms: float  # per token, decoding plainly
    skipped: int = 0  # replies started without speculation since


class NgramDrafter:
    """Prompt lookup: the last ``n`` tokens (n = max_ngram .. 1) matched at an earlier place in the chat (the
    latest with ``k`` tokens after it); the tokens that followed there are the draft. Strong where the reply
    copies (quoting, editing, code) or repeats itself."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram
        self._ids: list[int] = []  # the ids indexed so far
        self._starts: list[dict[tuple, list[int]]] = [{} for _ in range(max_ngram + 1)]  # n -> n-gram -> starts
        self._done = [0] * (max_ngram + 1)  # n -> starts indexed (0 .. done-1)

    def _index(self, ids: Sequence[int]) -> None:
        """Index the n-grams of ``ids`` that start before its last token; only the new ones when ``ids`` goes on
        from the ids seen last (a reply: one to k + 1 tokens a step), so a step costs what it adds, not the chat's
        length (it converted and scanned every token each step)."""
        L = len(self._ids)
        if len(ids) < L or list(ids[:L]) != self._ids:  # a new prompt, an edit: start over
            self._ids, L = [], 0
            self._starts = [{} for _ in range(self.max_ngram + 1)]
            self._done = [0] * (self.max_ngram + 1)
        self._ids.extend(int(t) for t in ids[L:])
        a, T = self._ids, len(self._ids)
        for n in range(1, self.max_ngram + 1):
            table = self._starts[n]
            for s in range(self._done[n], T - n):  # windows inside ids[:T-1]
                table.setdefault(tuple(a[s:s + n]), []).append(s)
            self._done[n] = max(self._done[n], T - n)

    def propose(self, ids: Sequence[int], k: int, sampler: Sampler | None = None) -> list[int]:
        self._index(ids)
        a, T = self._ids, len(self._ids)
        for n in range(min(self.max_ngram, T - 1), 0, -1):
            hits = self._starts[n].get(tuple(a[T - n:]))
            if hits:
                # the latest match with k tokens after it (the likeliest continuation in a chat); in a loop the
                # latest match ends next to the tail, so else the earliest (the longest continuation)
                i = bisect.bisect_right(hits, T - n - k) - 1
                start = (hits[i] if i >= 0 else hits[0]) + n
                out = a[start:start + k]
                period = T - start  # the match repeats every ``period`` tokens: copy on past the end (LZ77-style)
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []

    def close(self) -> None:
        pass


def verify(sampler: Sampler, logits: torch.Tensor, drafts: Sequence[int], context: Sequence[int]) -> list[int]:
    """The tokens one verification yields: the drafts that stay, then one of the model's (a correction, or the
    bonus token after the last draft). ``logits`` [k+1, vocab]: row i predicts the token after ``drafts[:i]``;
    ``context``: the chat's ids before the first draft (for the penalties). Each token is ``sampler``'s own
    choice at its position (greedy: the argmax; sampling: one draw from p), so the tokens — and the generator's
    state after them — are plain decoding's; a draft stays while it is that choice (see the module doc)."""
    needs_ctx = sampler.cfg.repetition_penalty != 1.0
    out: list[int] = []
    for i in range(len(drafts) + 1):
        ctx = torch.tensor(list(context) + out, dtype=torch.long) if needs_ctx else None
        out.append(sampler(logits[i], ctx))  # counts it too (presence / frequency penalties of the next ones)
        if i == len(drafts) or out[-1] != drafts[i]:
            break
    return out


@dataclass
class SpecStats:
    """One reply's speculation, for the footer, the CLI's JSON and the server's metrics."""

    drafts: int = 0  # verifications run
    draft_tokens: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens the verifications yielded (accepted + one each)
    by_pos: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)  # accepted at draft position i
    tried_pos: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)  # drafts offered at position i
    verify_ms: float = 0.0
    plain_ms: float = 0.0
    plain_steps: int = 0
    off_reason: str = ""

    def rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    def summary(self) -> str:
        if not self.drafts:
            return ""
        per = self.tokens / self.drafts
        return (f"speculative: {self.accepted} of {self.draft_tokens} draft tokens accepted ({self.rate():.0%}), "
                f"{per:.1f} tokens per forward")


class Speculator:
    """One chat's speculative decoding: drafter, k, and its measured worth. Owned by the session's thread."""

    def __init__(self, cfg: SpecConfig, drafter, verdicts: dict | None = None) -> None:
        """``verdicts``: the model's record of what paid (``ModelRunner.spec_verdicts``), shared by its chats."""
        self.cfg, self.drafter = cfg, drafter
        self.k = cfg.draft_tokens or START_K
        self.stats = SpecStats()
        self.probe = 0  # plain steps still to run to time plain decoding
        self.verdicts = verdicts if verdicts is not None else {}

    def new_reply(self) -> str:
        """A new reply: counts from zero; off from the start (a note says so) when it did not pay on this model
        in an earlier reply, except every ``RETRY_EVERY``-th reply."""
        self.stats = SpecStats()
        self.probe = 0
        v = self.verdicts.get(self.cfg.label)
        if not self.cfg.auto_off or v is None or v.pays:
            return ""
        v.skipped += 1
        if v.skipped % RETRY_EVERY == 0:
            return ""
        self.stats.off_reason = (f"speculation off for this reply: it was slower than decoding plainly on this model "
                                 f"({v.spec_ms:.1f} vs {v.plain_ms:.1f} ms per token); every {RETRY_EVERY}th reply "
                                 "tries it again")
        return self.stats.off_reason

    @property
    def active(self) -> bool:
        return not self.stats.off_reason

    def propose(self, ids: Sequence[int], room: int, sampler: Sampler) -> list[int]:
        """Up to ``min(k, room)`` draft tokens after ``ids`` ([] : decode plainly this step)."""
        if not self.active or room < 1:
            return []
        if self.probe > 0:
            self.probe -= 1
            return []
        try:
            return list(self.drafter.propose(ids, min(self.k, room), sampler))[:min(self.k, room)]
        except Exception as e:  # noqa: BLE001 - the reply goes on without drafts; the reason is shown
            reset = getattr(self.drafter, "reset", None)
            if reset is not None:
                reset()
            self.stats.off_reason = f"speculation off for this reply: the drafter failed ({e})"
            return []

    def record_plain(self, ms: float) -> None:
        self.stats.plain_ms += ms
        self.stats.plain_steps += 1

    def record_verify(self, drafts: int, kept: int, yielded: int, ms: float) -> str:
        """A verification of ``drafts`` tokens kept ``kept`` of them and gave ``yielded`` tokens in ``ms``: adapt
        k; a note when speculation turns itself off for the reply ("" otherwise)."""
        s = self.stats
        s.drafts += 1
        s.draft_tokens += drafts
        s.accepted += kept
        s.tokens += yielded
        s.verify_ms += ms
        for i in range(drafts):
            s.tried_pos[i] += 1
            s.by_pos[i] += i < kept
        if not self.cfg.draft_tokens:  # HF's heuristic schedule: +2 after a full accept, -1 otherwise
            self.k = min(MAX_DRAFT, self.k + 2) if kept == drafts else max(1, self.k - 1)
        return self._judge()

    def _judge(self) -> str:
        s = self.stats
        if not self.cfg.auto_off or not self.active or s.drafts < MIN_VERIFY or s.drafts % MIN_VERIFY:
            return ""
        if s.plain_steps < PROBE_STEPS:
            self.probe = PROBE_STEPS - s.plain_steps  # time plain decoding before judging
            return ""
        spec = s.verify_ms / max(1, s.tokens)
        plain = s.plain_ms / s.plain_steps
        old = self.verdicts.get(self.cfg.label)
        self.verdicts[self.cfg.label] = Verdict(plain >= spec * PAYS, spec, plain, old.skipped if old else 0)
        if plain < spec * PAYS:
            s.off_reason = (f"speculation off for this reply: {spec:.1f} ms per token against {plain:.1f} ms "
                            f"decoding plainly ({s.rate():.0%} of draft tokens accepted)")
            return s.off_reason
        return ""

    def close(self) -> None:
        self.drafter.close()
