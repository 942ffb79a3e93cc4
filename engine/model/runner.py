"""``ModelRunner``: the one place that calls a loaded model. One per ``LoadedModel`` (``lm.runner``).

Input: ``Work`` items, each the next tokens of one sequence (a prefill chunk or one decode token) with the
sequence's cache, its RoPE position and whether its policy reads attention scores. Output: the logits of each
item's last position and what ran it. The caller (``engine.core.step``) has reserved room in each item's store
before and commits or rolls back after: the runner never changes bookkeeping, only the K/V its forward writes
into reserved slots.

Paths, chosen here and nowhere else:

    off       no cache: the whole text, every step (``Work.kv`` None)
    eager     the model as transformers runs it, over one sequence's store
    compiled  the model's compiled decode step (``engine.model.fast_step``, its back end) for one token on a plain
              paged store, when it is ready and measured faster
    batched   several sequences in one forward, their tokens end to end — decode tokens, and a prefill chunk
              beside them: the weights are read once for all; attention stays per sequence
              (``engine.kv.store.attention.ragged_attention``)
    compiled batch
              one token of each of several sequences on plain paged stores of one arena, through the compiled
              batched step (``engine.model.fast_batch``) when it is ready and measured faster

Attention: the runner selects one implementation on the model once, ``kvscope`` (a dispatcher registered with
transformers' ``AttentionInterface``: sdpa unless the cache hands the call a batch's per-sequence K/V or a
score sink), so no call changes the model's config around it and transformers' own ``generate`` on the same
model runs plain sdpa. Models whose code tests for the name ``"sdpa"`` or that run another implementation keep
theirs; a score-reading policy then switches them to the scores attention while it runs.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from engine.kv.store.attention import DISPATCH_IMPL, SCORES_IMPL, use_attention
from engine.kv.hf_cache import BatchCache, KVCache, RaggedUnsupported

# KVSCOPE_ROTATED_READS=off reads tq pages back in the original basis (a D×D turn per cached token): to measure
# what the rotated reads save (engine/README.md, "KV precision")
ROTATED_READS = os.environ.get("KVSCOPE_ROTATED_READS", "on") != "off"


@dataclass(frozen=True)
class Work:
    """One sequence's next forward: feed ``ids`` from RoPE position ``rope`` through ``kv`` (None: no cache)."""

    ids: tuple[int, ...]
    rope: int
    kv: KVCache | None
    all_logits: bool = False  # logits at every fed position (a speculative verification), not only the last

    @property
    def q(self) -> int:
        return len(self.ids)

    @property
    def scores(self) -> bool:
        """The sequence's policy reads attention probabilities or queries (its cache carries a sink or observer)."""
        return self.kv is not None and (self.kv.score_sink is not None or self.kv.query_sink is not None)


class Output(NamedTuple):
    logits: torch.Tensor  # [vocab]: the last fed position's; [q, vocab] for ``Work.all_logits``
    path: str  # eager | compiled | batched | compiled batch | speculative
    batch: int = 1  # sequences the forward carried


class ModelRunner:
    """Runs ``Work`` on one loaded model; owns its attention choice and its compiled decode step (``fast``)."""

    def __init__(self, lm) -> None:
        from engine.model.fast_step import FastStep

        self.lm, self.model = lm, lm.model
        self.base_impl = lm.info.attn_impl
        self.dispatch = self.base_impl == "sdpa" and not _tests_for_sdpa(lm.model)
        if self.dispatch:
            use_attention(self.model, DISPATCH_IMPL)
        # the cache's K/V reach the attention as they are (not MLA's latent, which the model expands after the
        # cache: pages left rotated or as codes for the fused kernel would be expanded as placeholders)
        cfg = lm.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.reads_as_cached = getattr(text, "kv_lora_rank", None) is None
        self.batch_refused = ""  # why this model's sequences cannot decode in one forward, once found
        self.fast = FastStep(lm)  # with its batched step (the setter)
        self.forwards = 0  # forwards run (tests check every forward of the engine came through here)
        self.batched_forwards = self.batched_tokens = 0  # forwards that decoded several sequences, their tokens
        self.spec_verdicts: dict = {}  # drafter label -> engine.core.verify.Verdict: did speculation pay here

    @property
    def fast(self):
        """The model's compiled decode step (``engine.model.fast_step``) and, as its ``batch``, the compiled batched
        step (``engine.model.fast_batch``)."""
        return self._fast

    @fast.setter
    def fast(self, step) -> None:
        from engine.model.fast_batch import BatchStep

        if step.kind == "step" and step.batch is None:
            step.batch = BatchStep(step.lm, step.mode)
        self._fast = step

    # -- can I? -----------------------------------------------------------------------------------------
    def batch_refusal(self) -> str:
        """Why this model's sequences cannot decode together ("" when they can)."""
        info = self.lm.info
        if self.batch_refused:
            return self.batch_refused
        if not self.dispatch:
            return f"its attention runs as {info.attn_impl!r} (batched decoding uses sdpa)"
        if info.layer_kinds and any(k != "full" for k in info.layer_kinds):
            return "its layers are not all full attention (sliding windows or states are stepped one by one)"
        return ""

    def can_batch(self, work: Work) -> bool:
        """May ``work`` join a batched forward? Tokens (one to decode, a prefill chunk, or a verification's token
        and drafts) on a plain store, no score sink."""
        from engine.kv.store.contiguous import ContiguousKV
        from engine.kv.store.storage import PagedKV

        return work.kv is not None and not work.scores and type(work.kv.store) in (PagedKV, ContiguousKV)

    # -- do it ------------------------------------------------------------------------------------------
    def run(self, works: Sequence[Work]) -> list[Output]:
        """Forward every item: several together in one forward when they can batch (decode tokens, and prefill
        chunks beside them, laid end to end), else one by one. All or nothing for the caller: an exception means
        no output (each item's store is rolled back by it)."""
        if len(works) > 1 and not self.batch_refusal() and all(self.can_batch(w) for w in works):
            try:
                return self._batched(works)
            except RaggedUnsupported as e:  # found at the first try: remembered, then one by one
                self.batch_refused = str(e)
        return [self._one(w) for w in works]

    def _one(self, w: Work) -> Output:
        if w.kv is None:
            return Output(self._off(w), "eager")
        if w.all_logits:
            return Output(self._eager(w), "speculative")
        fast = self.fast
        path = fast.choose(w.kv.store, w.scores) if w.q == 1 else ""
        t0 = time.perf_counter()
        logits = self._compiled(w) if path == "compiled" else None
        if logits is None:
            logits, path = self._eager(w), path and "eager"
        self._timed(fast, path, t0, 1)
        return Output(logits, path or "eager")

    def _timed(self, fast, path: str, t0: float, n: int) -> None:
        """A trial's time of an eligible forward begun at ``t0`` (per sequence of ``n``: batches differ)."""
        if not path:
            return
        if self.lm.device.type == "cuda":
            torch.cuda.synchronize(self.lm.device)  # the trial times the forward, not its launch
        fast.record(path, (time.perf_counter() - t0) * 1000.0 / n)

    def _off(self, w: Work) -> torch.Tensor:
        dev = self.lm.device
        self._select(False)
        ids = torch.tensor([w.ids], dtype=torch.long, device=dev)  # [1, n]: the whole text
        pos = torch.arange(w.rope, w.rope + w.q, device=dev)[None]  # [1, n]
        with torch.inference_mode():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=0 if w.all_logits else 1)
        self.forwards += 1
        return out.logits[0] if w.all_logits else out.logits[0, -1]  # [n, vocab] or [vocab]

    def _eager(self, w: Work) -> torch.Tensor:
        dev = self.lm.device
        self._select(w.scores)
        # tq pages read rotated, the queries and output turned instead, by our attention when nothing reads its insides
        w.kv.rotated_ok = self.dispatch and self.reads_as_cached and not w.scores and ROTATED_READS
        ids = torch.tensor([w.ids], dtype=torch.long, device=dev)  # [1, q]
        pos = torch.arange(w.rope, w.rope + w.q, device=dev)[None]  # [1, q] RoPE positions
        with torch.inference_mode():
            out = self.model(input_ids=ids, cache=w.kv, position_ids=pos, use_cache=True,
                             logits_to_keep=0 if w.all_logits else 1)
        self.forwards += 1
        return out.logits[0] if w.all_logits else out.logits[0, -1]  # [q, vocab] or [vocab]

    def _compiled(self, w: Work) -> torch.Tensor | None:
        """The compiled step's logits; None if it failed (nothing was written: eager answers instead)."""
        try:
            logits = self.fast.forward(w.kv.store, w.ids[0], w.rope)
        except Exception as e:  # noqa: BLE001 - the eager path answers; the reason is kept and shown
            self.fast.fail(e)
            return None
        self.forwards += 1
        return logits

    def _batched(self, works: Sequence[Work]) -> list[Output]:
        """Several sequences in one forward: the compiled batched step (``engine.model.fast_batch``) for one token
        each when it is ready and measured faster, else the eager batched forward (prefill chunks and
        verifications beside the decodes, ragged: k + 1 positions for a verification, its logits at each)."""
        batch, path = self.fast.batch, ""
        if batch is not None and all(w.q == 1 for w in works):
            self.fast.start_batch()  # built once several sequences decode together
            path = batch.choose([w.kv.store for w in works])
        t0 = time.perf_counter()
        logits = self._batched_compiled(works) if path == "compiled" else None
        if logits is None:
            logits, path = self._batched_eager(works), path and "eager"
        self._timed(batch, path, t0, len(works))
        self.forwards += 1
        self.batched_forwards += 1
        self.batched_tokens += len(works)
        kind = "compiled batch" if path == "compiled" else "batched"
        outs, at = [], 0
        for w in works:  # logits [M, vocab]: each work's last position, every position of a verification
            if w.all_logits:
                outs.append(Output(logits[at:at + w.q], "speculative", len(works)))  # [q, vocab]
                at += w.q
            else:
                outs.append(Output(logits[at], kind, len(works)))  # [vocab]
                at += 1
        return outs

    def _batched_compiled(self, works: Sequence[Work]) -> torch.Tensor | None:
        """The compiled batched step's logits [B, vocab]; None if it failed (nothing was written: eager answers)."""
        try:
            return self.fast.batch.forward([w.kv.store for w in works], [w.ids[0] for w in works],
                                           [w.rope for w in works])
        except Exception as e:  # noqa: BLE001 - the eager path answers; the reason is kept and shown
            self.fast.batch.fail(e)
            return None

    def _batched_eager(self, works: Sequence[Work]) -> torch.Tensor:
        dev = self.lm.device
        lens = [w.q for w in works]
        ids = torch.tensor([[t for w in works for t in w.ids]], dtype=torch.long, device=dev)  # [1, N]
        pos = torch.tensor([[p for w in works for p in range(w.rope, w.rope + w.q)]], device=dev)  # [1, N] RoPE
        ends = list(itertools.accumulate(lens))
        keep = [i for w, end in zip(works, ends) for i in (range(end - w.q, end) if w.all_logits else (end - 1,))]
        keep = torch.tensor(keep, device=dev)  # [M]: each segment's last token, a verification's every token
        cache = BatchCache([w.kv.store for w in works], lens, rotated_ok=ROTATED_READS and self.reads_as_cached)
        with torch.inference_mode():
            out = self.model(input_ids=ids, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=keep)
        return out.logits[0]  # [M, vocab]

    def _select(self, scores: bool) -> None:
        """The attention this forward needs: with the dispatcher selected, nothing to change."""
        if not self.dispatch:
            use_attention(self.model, SCORES_IMPL if scores else self.base_impl)


def step_function(model):
    """The compiled step's body: one token over a plain paged store's page tensors, read through
    ``engine.kv.hf_cache.StepCache``; nothing is written (the new K/V come back). Exported and compiled ahead of
    time in a child process (``engine.model.aot_step``); the runner calls the package (``engine.model.fast_step``)."""
    from engine.kv.hf_cache import StepCache

    def step(ids, pos, slots, ks, vs):
        cache = StepCache(ks, vs, slots)
        out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        nk, nv = cache.new_kv()
        return out.logits[0, -1], nk, nv  # [vocab], L x [1, Hk, 1, Dk], L x [1, Hv, 1, Dv]

    return step


def batch_step_function(model):
    """The compiled batched step's body: one token of each of B sequences over one arena's page tensors, read
    through ``engine.kv.hf_cache.BatchStepCache`` (padded to the longest, the padding masked); nothing is written
    (the new K/V come back). Built like ``step_function``; the runner calls it through ``engine.model.fast_batch``."""
    from engine.kv.hf_cache import BatchStepCache

    def step(ids, pos, slots, lens, ks, vs):
        cache = BatchStepCache(ks, vs, slots, lens)
        out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        nk, nv = cache.new_kv()
        return out.logits[:, -1], nk, nv  # [B, vocab], L x [B, Hk, 1, Dk], L x [B, Hv, 1, Dv]

    return step


def _tests_for_sdpa(model) -> bool:
    """Does the model's own code branch on the attention being named ``"sdpa"`` (Falcon, Gemma 4, ...)? Then the
    dispatcher, registered under another name, would change what it computes."""
    mod = sys.modules.get(type(model).__module__)
    path = getattr(mod, "__file__", None)
    try:
        text = Path(path).read_text(encoding="utf-8") if path else ""
    except OSError:
        return True
    return '_attn_implementation == "sdpa"' in text or "_attn_implementation != \"sdpa\"" in text
