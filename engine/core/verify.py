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
# Auto-off judges early and on what speculation costs now: from the MIN_VERIFY-th verification on, at every one,
# the last WINDOW verifications' ms per token they yielded against a plain step's ms; below PAYS it stops for the
# reply. On stories260K's compiled step a plain step is ~0.6 ms and a verification (eager, k + 1 tokens) ~3.1 ms:
# judged every 4th verification on the reply's running average, a good start (the copy's first tokens) kept it on
# for 60 verifications after acceptance fell, and the copy scenario ran x0.64 of plain decoding.
MIN_VERIFY, WINDOW, PROBE_STEPS, PAYS = 2, 4, 2, 0.97
# The plain step's time is measured by PROBE_STEPS plain steps at the start of a reply (plain steps between
# verifications run ~1.6x slower: 1.0 vs 0.6 ms there) and kept per model and drafter, so later replies judge
# from their second verification without a probe. A reply where it did not pay still starts speculating (its
# acceptance is shown), and stops at its first judgement unless this chat copies.
# Paused, it resumes when the last WINDOW guesses would have cost under RESUMES x a plain step per token: a margin,
# as plain steps between verifications run slower (above) and the copy scenario resumed into losses at PAYS.
RESUMES = 0.75
SHADOW_K = 2 * START_K  # a paused prompt lookup's guesses: longer ones take as many plain steps to be decided


@dataclass
class Verdict:
    """What speculation with one drafter measured on one model, last time it was judged."""

    pays: bool
    spec_ms: float  # per token, speculating
    plain_ms: float  # per token, decoding plainly
    skipped: int = 0  # replies started without speculation since (none now: kept for the record's shape)


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
    probe_ms: list[float] = field(default_factory=list)  # plain steps before the first verification
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
        self.verdicts = verdicts if verdicts is not None else {}
        self.new_reply()  # probe: plain steps still to run to time plain decoding

    def new_reply(self) -> str:
        """A new reply: counts from zero. The plain step's time is the model's, when an earlier reply measured it;
        else the reply's first PROBE_STEPS decode steps measure it (before any verification). Always "" now:
        every reply speculates until its first judgement says otherwise."""
        self.stats = SpecStats()
        self._recent: list[tuple[float, int]] = []  # the last WINDOW verifications: (ms, tokens yielded)
        self._paused = False  # turned off by the judge, prompt lookup guessing in the shadow (``_shadow``)
        self._pending: tuple[int, list[int]] | None = None  # a shadow guess: (where it starts, its tokens)
        self._guessed: list[int] = []  # the last WINDOW shadow guesses: tokens a verification would have yielded
        self._told = False  # the reply's notes said why it paused once: a later pause is in ``off_reason`` only
        v = self.verdicts.get(self.cfg.label)
        self._plain_prior = v.plain_ms if v is not None else 0.0
        self.probe = PROBE_STEPS if self.cfg.auto_off and not self._plain_prior else 0
        return ""

    @property
    def label(self) -> str:
        """Its drafter as the reply's stats name it (``SpecConfig.label``)."""
        return self.cfg.label

    @property
    def active(self) -> bool:
        return not self.stats.off_reason

    def propose(self, ids: Sequence[int], room: int, sampler: Sampler) -> list[int]:
        """Up to ``min(k, room)`` draft tokens after ``ids`` ([] : decode plainly this step)."""
        if not self.active:
            return self._shadow(ids, room, sampler) if self._paused and room >= 1 else []
        if room < 1:
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

    def _shadow(self, ids: Sequence[int], room: int, sampler: Sampler) -> list[int]:
        """Paused by the judge: prompt lookup still guesses (a dict lookup: ~10 µs against a ~0.6 ms step) and
        the plain tokens that follow say how many a verification would have kept; when the last WINDOW guesses
        would pay at the verifications' measured cost, speculation goes on (a reply that starts telling its own
        story and then repeats a line: stories260K on the repeat starter). Always [] (this step is plain)."""
        if self._pending is not None:
            pos, guess = self._pending
            got = list(ids[pos:pos + len(guess)])
            kept = next((i for i, (a, b) in enumerate(zip(got, guess)) if a != b), len(got))
            if kept < len(got) or len(got) == len(guess):  # decided: a wrong guess, or all of it came
                self._guessed = (self._guessed + [kept + 1])[-WINDOW:]
                self._pending = None
            else:
                return []
        # the cheapest recent verification: a shape's first call warms up (x10 on a loaded host), and a mean over it
        # kept the repeat starter paused for a whole reply of repeats
        per_verify = min((m for m, _ in self._recent), default=0.0)
        if len(self._guessed) == WINDOW and per_verify / (sum(self._guessed) / WINDOW) < RESUMES * self._plain_ms():
            run = round(sum(self._guessed) / WINDOW) - 1  # the drafts a guess kept: where the schedule goes on
            self.stats.off_reason, self._paused, self._recent, self._guessed, self.probe = "", False, [], [], 0
            self.k = self.cfg.draft_tokens or max(START_K, min(SHADOW_K, run))
            return []
        # SHADOW_K tokens, not the k the misses before the pause shrank (2 after two misses: at most 3 tokens a
        # verification, so a 27 ms verification against a 9.5 ms plain step on a loaded host never resumed on a reply
        # of repeats); the schedule grows k to MAX_DRAFT on a long copy, and a resumed one starts at what they kept
        n = min(self.cfg.draft_tokens or SHADOW_K, room)
        guess = list(self.drafter.propose(ids, n, sampler))[:n]
        self._pending = (len(ids), guess) if guess else None
        return []

    def record_plain(self, ms: float) -> None:
        self.stats.plain_ms += ms
        self.stats.plain_steps += 1
        if self.stats.plain_steps <= PROBE_STEPS and not self.stats.drafts:
            self.stats.probe_ms.append(ms)  # before any verification: the steady plain step

    def record_verify(self, drafts: int, kept: int, yielded: int, ms: float) -> str:
        """A verification of ``drafts`` tokens kept ``kept`` of them and gave ``yielded`` tokens in ``ms``: adapt
        k; a note when speculation turns itself off for the reply ("" otherwise)."""
        s = self.stats
        s.drafts += 1
        s.draft_tokens += drafts
        s.accepted += kept
        s.tokens += yielded
        s.verify_ms += ms
        self._recent = (self._recent + [(ms, yielded)])[-WINDOW:]
        for i in range(drafts):
            s.tried_pos[i] += 1
            s.by_pos[i] += i < kept
        if not self.cfg.draft_tokens:  # HF's heuristic schedule: +2 after a full accept, -1 otherwise
            self.k = min(MAX_DRAFT, self.k + 2) if kept == drafts else max(1, self.k - 1)
        return self._judge()

    def _plain_ms(self) -> float:
        """A plain step's ms: this reply's probe before its first verification, else the model's, else the
        plain steps of this reply (0: none yet)."""
        probe = self.stats.probe_ms
        if probe:
            return min(probe)  # the first decode step may still warm up: the faster of the two
        if self._plain_prior:
            return self._plain_prior
        s = self.stats
        return s.plain_ms / s.plain_steps if s.plain_steps else 0.0

    def _judge(self) -> str:
        s = self.stats
        if not self.cfg.auto_off or not self.active or len(self._recent) < MIN_VERIFY:
            return ""
        plain = self._plain_ms()
        if not plain:
            self.probe = PROBE_STEPS - s.plain_steps  # time plain decoding before judging
            return ""
        spec = sum(m for m, _ in self._recent) / max(1, sum(n for _, n in self._recent))
        pays = plain >= spec * PAYS
        self.verdicts[self.cfg.label] = Verdict(pays, spec, plain)
        if pays:
            return ""
        self._paused = self.drafter.name == "ngram"  # a draft model's guesses cost a forward: no shadow
        # the last verifications' cost, not the reply's acceptance so far: that changes, and the footer says it
        # at the end (a note of "0% accepted" at an early pause stood under a footer of 86%)
        took = (f"its last {len(self._recent)} verifications took {spec:.1f} ms per token against {plain:.1f} ms "
                "decoding plainly")
        s.off_reason = (f"speculation off for now: {took}; prompt lookup goes on guessing, and it comes back where "
                        "the reply repeats" if self._paused else f"speculation off for this reply: {took}")
        if self._told:  # paused again after it came back: said once a reply (four notes in one reply before)
            return ""
        self._told = True
        return s.off_reason

    def close(self) -> None:
        self.drafter.close()
