"""One reply's tokens as the timing panel reads them: ``TokenSeries`` (per-token step times, the prefill, the
speculative verifications' counts) and the captions made from it."""

from __future__ import annotations

import numpy as np

from engine.snapshot import TokenEvent

ROLLING = 16  # tokens in the rolling tok/s window
BARS = "▁▂▃▄▅▆▇█"  # a share from 0 to 1 as a bar one character wide


def p98(a: np.ndarray) -> float:
    """98th percentile (nearest rank) by one partial sort: cheaper than np.percentile on every redraw."""
    if not len(a):
        return 0.0
    k = min(len(a) - 1, int(0.98 * len(a)))
    return float(np.partition(a, k)[k])


class TokenSeries:
    """Growable arrays of one reply's per-token step times (doubling, so appends stay O(1))."""

    def __init__(self, capacity: int = 512) -> None:
        self.ms = np.zeros(capacity, dtype=np.float64)
        self.n = 0
        self.prefill_ms = 0.0  # the prefill's work: every chunk's forward (the engine's, once a snapshot gave it)
        self.ttft_ms = 0.0  # the engine's TTFT (waits never in it); 0 until a snapshot gave it
        self.speed = 0.0  # the engine's decode tok/s (the frame's, then the finished reply's): the status bar's figure
        self.final = False  # the reply finished: ``speed`` and ``ttft_ms`` are its stats', no snapshot changes them
        self.prefill_tokens = 0
        self.policy_prefill_ms = 0.0  # the eviction policy's own work (scoring, choosing) in the prefill
        self.policy_decode_ms = 0.0  # ... over the decode steps so far
        self.label = ""
        self.paths: dict[str, int] = {}  # decode tokens per path that ran their forward (TokenEvent.path)
        self.forwards = 0  # decode forwards (a verification's later tokens come without one)
        self.verifications = 0  # of them, speculative verifications
        self.tried: list[int] = []  # draft tokens verified at draft position 1, 2, ...
        self.accepted: list[int] = []  # of them, those the model kept
        self._position = 0  # draft position of the next accepted draft token of the current verification
        self._group = 0  # index of the first token of the last forward (its later tokens share its time)
        self.spec_tokens = 0  # tokens the verifications gave

    def add(self, event: TokenEvent) -> None:
        if event.phase == "prefill":
            self.prefill_ms = float(event.step_ms)
            self.prefill_tokens = int(event.tokens_in_step)
            return
        if self.n == len(self.ms):
            self.ms = np.concatenate([self.ms, np.zeros_like(self.ms)])
        self.ms[self.n] = event.step_ms
        self.n += 1
        path = getattr(event, "path", "eager")
        self.paths[path] = self.paths.get(path, 0) + 1
        self._count_speculation(event, path)
        if event.tokens_in_step > 0:
            self._group = self.n - 1
        else:  # a verification's later token: the forward's time is shared by every token it gave
            group = self.ms[self._group:self.n]
            group[:] = group.sum() / len(group)

    def _count_speculation(self, event: TokenEvent, path: str) -> None:
        """A verification's first token carries the forward (``tokens_in_step``: its token and k drafts); the
        tokens it gave follow, the drafts it kept marked ``draft``, in draft-position order."""
        if event.tokens_in_step > 0:
            self.forwards += 1
            self._position = 0
            if path == "speculative":
                self.verifications += 1
                self.spec_tokens += 1
                k = event.tokens_in_step - 1
                grow = max(0, k - len(self.tried))
                self.tried += [0] * grow
                self.accepted += [0] * grow
                for i in range(k):
                    self.tried[i] += 1
        elif self.verifications:  # a later token of the last verification
            self.spec_tokens += 1
        if getattr(event, "draft", False) and self._position < len(self.accepted):
            self.accepted[self._position] += 1
            self._position += 1

    def spec_text(self) -> str:
        """'speculative: 7.9 tokens per verification, 6.0 per forward overall · 83% of draft tokens kept · by draft
        position ▆▇▇█ (67% at 1)': one bar per draft position, its height the share kept there ("" when the
        reply did not speculate). Per verification is the footer's "tokens per forward" (``TurnStats.spec_note``);
        overall counts the plain steps between verifications too."""
        if not self.verifications:
            return ""
        per = self.n / max(self.forwards, 1)
        per_check = self.spec_tokens / self.verifications
        kept = sum(self.accepted) / max(sum(self.tried), 1)
        rates = [a / t for a, t in zip(self.accepted, self.tried) if t]
        bars = "".join(BARS[min(len(BARS) - 1, int(round(r * (len(BARS) - 1))))] for r in rates)
        return (f"speculative: {per_check:.1f} tokens per verification, {per:.1f} per forward overall · {kept:.0%} of "
                f"draft tokens kept · by draft position {bars} ({rates[0]:.0%} at 1)" if rates else "")

    @property
    def decode_ms(self) -> np.ndarray:
        return self.ms[: self.n]

    def x(self) -> np.ndarray:
        """Token index within the reply of each decode token (the prefill token is index 0)."""
        return np.arange(1, self.n + 1, dtype=np.float64)

    def rolling_tps(self, window: int = ROLLING) -> np.ndarray:
        """tok/s over the last ``window`` decode tokens at each position."""
        ms = self.decode_ms
        if not len(ms):
            return ms.copy()
        c = np.concatenate([[0.0], np.cumsum(ms)])
        idx = np.arange(1, len(ms) + 1)
        lo = np.maximum(idx - window, 0)
        span = c[idx] - c[lo]
        return np.where(span > 0, 1000.0 * (idx - lo) / np.maximum(span, 1e-9), 0.0)


def series_speed(series: TokenSeries) -> float:
    """A reply's decode tok/s: the engine's figure once it gave one, else from its tokens' times."""
    ms = series.decode_ms
    return series.speed or (1000.0 * len(ms) / ms.sum() if len(ms) and ms.sum() > 0 else 0.0)


def saved_text(stats: dict) -> str:
    """The caption of a chat's last reply from an earlier run: its figures as saved with it (the footer's)."""
    if not stats or not stats.get("generated_tokens"):
        return ""
    ttft = f"TTFT {stats['ttft_ms']:.0f} ms · " if stats.get("ttft_ms") else ""
    speed = f" at <b>{stats['decode_tokens_per_s']:.1f} tok/s</b>" if stats.get("decode_tokens_per_s") else ""
    mode = f"cache {stats['mode']} · " if stats.get("mode") else ""
    return (f"<b>last reply</b> (saved: its tokens' times are not kept) · {mode}{ttft}"
            f"{int(stats['generated_tokens']):,} tokens{speed}")


def step_text(paths: dict[str, int], n: int) -> str:
    """What ran this reply's decode steps, short enough for the caption's first line: "compiled 95/95",
    "batched 12/40", or "eager" (the compiled step's state and reasons are in the caption's tooltip)."""
    parts = [f"{p} {paths[p]}/{n}" for p in ("compiled", "batched", "compiled batch") if n and paths.get(p)]
    return " + ".join(parts) if parts else "eager"
