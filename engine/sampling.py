"""Next-token choice: greedy, or the sampling pipeline with a seeded generator.

Order (as in HF's logits processors): repetition penalty → temperature → top-k → top-p → min-p → draw.
"""

from __future__ import annotations

import math

import torch

from engine.config import SamplingConfig
from engine.errors import NonFiniteLogitsError


class Sampler:
    """Chooses tokens for one reply. Owns the ``torch.Generator`` so a seed gives repeatable replies."""

    def __init__(self, cfg: SamplingConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.generator: torch.Generator | None = None
        if not cfg.greedy:
            self.generator = torch.Generator(device="cpu")
            if cfg.seed is not None:
                self.generator.manual_seed(int(cfg.seed))
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor, context_ids: torch.Tensor | None = None) -> int:
        """``logits``: [vocab] of the last position; ``context_ids``: [n] ids seen so far (for the penalty)."""
        logits = self.processed(logits, context_ids)
        if self.cfg.greedy:
            return int(torch.argmax(logits))
        return self.draw(sampling_probs(logits, self.cfg))

    def processed(self, logits: torch.Tensor, context_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` [vocab] after the penalties that depend on the context (float32)."""
        cfg = self.cfg
        logits = logits.float()
        top = float(logits.max())  # NaN anywhere makes the max NaN; one scalar read, as the token's own
        if not math.isfinite(top):
            raise NonFiniteLogitsError(
                f"the model's output is not a number ({'NaN' if math.isnan(top) else top} in its logits): its weights "
                "hold NaN/inf or its dtype overflowed (try float32); the reply was stopped")
        if cfg.repetition_penalty != 1.0 and context_ids is not None and context_ids.numel():
            logits = apply_repetition_penalty(logits, context_ids, cfg.repetition_penalty)
        return logits

    def distribution(self, logits: torch.Tensor, context_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The probabilities a sampled token is drawn from ([vocab]); speculative decoding's target."""
        return sampling_probs(self.processed(logits, context_ids), self.cfg)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from ``probs`` [vocab] with this reply's generator."""
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))

    def uniform(self) -> float:
        """A draw from U[0, 1) with this reply's generator (speculative acceptance)."""
        return float(torch.rand((), generator=self.generator))


def apply_repetition_penalty(logits: torch.Tensor, context_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (HF semantics): seen tokens' positive logits ÷ p, negative ones × p."""
    logits = logits.clone()
    ids = context_ids.to(logits.device).unique()
    seen = logits[ids]
    logits[ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits


def sampling_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p filtering. ``logits``: [vocab] float."""
    # in float64, the largest logit first to 0: a tiny temperature (1e-40, 1e-300 are valid; float32 holds
    # neither) then sends the others to -inf, never the largest to +inf (inf - inf in the softmax was NaN)
    logits = ((logits.double() - logits.max()) / cfg.temperature).float()  # [vocab]: max 0, the rest <= 0
    if cfg.top_k and cfg.top_k < logits.numel():
        kth = torch.topk(logits, cfg.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop_sorted = (cum - sorted_p) >= cfg.top_p  # keep the smallest prefix reaching top_p (≥ 1 token)
        drop_sorted[0] = False  # a top_p below float32's range (1e-46) compares as 0: the top token stays
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if cfg.min_p > 0.0:
        probs = probs.masked_fill(probs < cfg.min_p * probs.max(), 0.0)
    return probs / probs.sum()
