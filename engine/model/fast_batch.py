"""The compiled batched decode step: one token of each of several sequences in one call of a package built ahead of
time, like the single step (``engine.model.fast_step``: the same child process, cache, trial and states), from
``engine.model.runner.batch_step_function``.

Why it pays: an eager batched forward reads the weights once for all its sequences, but every op between the
products is a dispatch per op per layer (a round of 4 SmolLM2-shape chats: ~70 ms eager, of which the linears
are ~25). Compiled, the norms, RoPE, SiLU-mul, residual adds and page gathers become fused loops around the same
weight kernels.

One graph serves every batch size from 2 to ``aot_step.MAX_BATCH`` and every length: each sequence's cached K/V
are gathered from its pages (one arena's tensors, read in place) and padded to the longest; the attention masks
the padding (``engine.kv.store.attention.padded_attention``), so a masked key gets weight exactly 0 and a
sequence's tokens do not depend on what shares the batch. Nothing is written inside the call: the new K/V come
back and are written to each sequence's slot after it.

It is built only once several sequences decode together (a chat alone never pays for it), and never while the
single step's child is building (two builds on a small machine each take twice as long). The trial compares
the time per sequence of compiled and eager batched rounds (3 : 1, ``fast_step.TRIAL_STEPS``, fewer where plain), again each time
the longest context doubles. ``KVSCOPE_FAST_BATCH=off`` keeps the batches eager (the single step unchanged).
"""

from __future__ import annotations

import logging
import os

import torch

from engine.model import aot_step
from engine.model.fast_step import FastStep


def env_off() -> bool:
    """``KVSCOPE_FAST_BATCH=off``; any other value than on / auto / off is warned about (then not off)."""
    value = os.environ.get("KVSCOPE_FAST_BATCH", "").strip().lower()
    if value not in ("", "on", "auto", "off") and value not in _warned:
        _warned.add(value)
        logging.getLogger("kvscope").warning("KVSCOPE_FAST_BATCH=%r is not one of on, auto, off: ignored", value)
    return value == "off"


_warned: set[str] = set()


class BatchStep(FastStep):
    """The compiled batched decode step of one loaded model (owned by its ``FastStep``: same setting, same waker)."""

    kind = "batch"
    per = "a sequence"  # rounds of different sizes are timed per sequence

    def _refresh(self) -> None:
        super()._refresh()
        if env_off() and self.state != "compiling":
            self.state, self.reason = "off", "KVSCOPE_FAST_BATCH=off"  # to measure the eager batch beside it

    def refusal_of(self, stores) -> str:
        """Why one token of each of ``stores`` cannot be one call of this step ('' when it can, once compiled)."""
        if len(stores) > aot_step.MAX_BATCH:
            return f"more than {aot_step.MAX_BATCH} sequences"
        for store in stores:
            why = self.refusal(store)
            if why:
                return why
        if len({id(s.arena) for s in stores}) > 1:
            return "the sequences' pages are in different arenas (different cache settings)"
        if min(s.past_len for s in stores) < 1:
            return "a sequence has nothing cached"
        return ""

    def choose(self, stores, scores: bool = False) -> str:
        """"compiled" or "eager" for one token of each of ``stores`` (a finished build is taken up here)."""
        if self.state == "compiling":
            self.poll()
        if self.state in ("off", "failed", "idle", "compiling") or scores or self.refusal_of(stores):
            return "eager"
        return super().choose(max(stores, key=lambda s: s.past_len))

    def forward(self, stores, tokens, ropes):
        """The compiled forward of ``tokens[b]`` at RoPE position ``ropes[b]`` over ``stores[b]`` (room reserved by
        the caller; one arena): the logits [B, vocab], the new K/V written to each sequence's slot. Raises on
        failure; then at most those reserved slots were written, and the eager batch that answers instead writes
        them again."""
        dev = self.lm.device
        arena = stores[0].arena
        P = arena.page_size
        lens = [s.past_len for s in stores]
        n = max(lens)
        rows = []
        for s, m in zip(stores, lens):  # each sequence's cached slots, in order, padded with slot 0 (masked)
            pages = torch.tensor(s.table.pages[:-(-m // P)], dtype=torch.long)  # [pages]
            row = (pages[:, None] * P + torch.arange(P)).reshape(-1)[:m]  # [m]
            rows.append(torch.nn.functional.pad(row, (0, n - m)))  # [n]
        slots = torch.stack(rows).to(dev)  # [B, n]
        new = torch.tensor([s.table.pages[m // P] * P + m % P for s, m in zip(stores, lens)], device=dev)  # [B]
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)[:, None]  # [B, 1]
        pos = torch.tensor(ropes, dtype=torch.long, device=dev)[:, None]  # [B, 1]
        ks, vs = arena.roles["k"].layers, arena.roles["v"].layers
        with torch.inference_mode():
            logits, nk, nv = self._fn(ids, pos, slots, torch.tensor(lens, device=dev), ks, vs)
            for t, x in zip(ks + vs, nk + nv):
                t.index_copy_(1, new, x[:, :, 0].transpose(0, 1))  # [H, B, D] into each sequence's slot
        return logits  # [B, vocab]

    def describe(self) -> str:
        text = {"off": "off", "idle": "not compiled yet (built once several chats decode together)",
                "compiling": "compiling in the background", "trial": "compiled, measuring against eager",
                "on": "compiled batched step in use", "slower": "eager (compiled measured slower)",
                "failed": "eager (compile failed)"}[self.state]
        return f"{text} — {self.reason}" if self.reason else text
