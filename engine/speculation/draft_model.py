"""A draft model for speculative decoding: a smaller model with the target's tokenizer proposes the next tokens,
greedily, on its own paged cache in its own arena (its pages are the draft model's, never the target's).

The draft cache follows the chat: before each proposal it is cut back to the longest prefix it shares with the
chat (the target kept some drafts and replaced the next), then fed what is new, then ``k`` tokens are drafted one
forward each. A 260K-parameter draft model costs ~1 ms per token on this CPU, a 135M target ~25 ms.
"""

from __future__ import annotations

import itertools

import torch

from engine.config import CacheConfig
from engine.errors import EngineError
from engine.core.sequence import common_prefix, prefill_chunk
from engine.quant.modules import parameter_count

_owners = itertools.count(1_000_000)  # draft caches' owner ids: apart from chats' session ids


class DraftMismatchError(EngineError):
    """The draft model cannot draft for this target (another tokenizer or vocabulary)."""


def tokenizer_mismatch(draft_lm, target_lm) -> str:
    """Why ``draft_lm`` cannot draft for ``target_lm`` ("" when it can): the same tokenizer vocabulary (every
    token string with the same id) and no token id the target does not have."""
    dt, tt = draft_lm.tokenizer, target_lm.tokenizer
    if dt is None or tt is None:
        return "a model without a tokenizer cannot be checked against the other's"
    dv, tv = dt.get_vocab(), tt.get_vocab()
    if dv != tv:
        differ = sorted(set(dv.items()) ^ set(tv.items()))[:3]
        return (f"its tokenizer differs from the model's ({len(dv)} vs {len(tv)} tokens; e.g. "
                + ", ".join(f"{t!r}→{i}" for t, i in differ) + "): drafts would be other tokens")
    d_vocab, t_vocab = draft_lm.info.vocab_size, target_lm.info.vocab_size
    if d_vocab > t_vocab:
        return f"its vocabulary ({d_vocab}) is larger than the model's ({t_vocab})"
    return ""


class ModelDrafter:
    """Greedy drafts from ``draft_lm`` for chats of ``target_lm`` (``DraftMismatchError`` if it cannot)."""

    name = "draft"

    def __init__(self, draft_lm, target_lm, check: bool = True) -> None:
        why = tokenizer_mismatch(draft_lm, target_lm) if check else ""
        if why:
            raise DraftMismatchError(f"draft model {draft_lm.info.name}: {why}")
        from engine.core.seq_cache import SeqCache

        self.lm = draft_lm
        self.cache = SeqCache(draft_lm, CacheConfig(mode="paged", page_size=16, prefix_reuse=False), next(_owners))
        self.fed: list[int] = []  # the tokens whose K/V the draft cache holds, in order
        self.chunk = prefill_chunk(parameter_count(draft_lm.model), draft_lm.device.type)
        self.forwards = 0

    def propose(self, ids, k: int, sampler=None) -> list[int]:
        """Up to ``k`` greedy draft tokens after ``ids``."""
        k = min(k, self.lm.info.context_length - len(ids) - 1)
        if k < 1:
            return []
        keep = min(common_prefix(self.fed, ids), len(ids) - 1, self.cache.n)
        if keep < self.cache.n:
            self.cache.truncate(keep)
        seq, drafts = list(ids), []
        while len(drafts) < k:
            work, cx = self.cache.next_forward(seq, 0, None, self.chunk, owner=0)
            try:
                (out,) = self.lm.runner.run([work])
            except BaseException:
                self.cache.rollback()
                raise
            self.forwards += 1
            done = self.cache.forward_done(work, out, cx, seq)
            self.fed = seq[:self.cache.index.next_pos]
            if done:
                token = int(torch.argmax(out.logits))
                drafts.append(token)
                seq.append(token)
        return drafts

    def reset(self) -> None:
        self.cache.reset()
        self.fed = []

    def close(self) -> None:
        """Give the draft cache's pages back (the draft model stays loaded for whoever holds it)."""
        self.cache.free()
        self.fed = []


def load_drafter(cfg, target_lm, like=None) -> ModelDrafter | None:
    """The drafter ``cfg`` (``engine.core.verify.SpecConfig``) names for ``target_lm``: a draft model loaded from
    ``cfg.draft_path`` on the target's device (trust settings and dtype as ``like``, a ``ModelSpec``), checked
    against its tokenizer; None for the other methods. Typed errors (``DraftMismatchError``, load errors)."""
    if cfg.method != "draft":
        return None
    import dataclasses

    from engine.config import ModelSpec
    from engine.model.loader import load_model

    base = like if like is not None else ModelSpec(source=cfg.draft_path)
    spec = dataclasses.replace(base, source=cfg.draft_path, device=target_lm.device.type, quantization="none")
    try:
        lm = load_model(spec)
    except (EngineError, ValueError) as e:  # say which model failed: the main one loaded already
        e.args = (f"draft model {cfg.draft_path}: {e}",) + e.args[1:]
        raise
    return ModelDrafter(lm, target_lm)


def speculation(cfg, draft_lm, target_lm, check: bool = True):
    """A pool's ``Speculation`` (``engine.core.speculation_setup``) for ``cfg`` drafting with ``draft_lm`` (loaded
    once, shared by every drafter) for ``target_lm``. ``check``: a draft model with another tokenizer is refused
    now (``DraftMismatchError``), not at the first chat. For a method other than draft, ``draft_lm`` is not used."""
    from engine.config import SpecConfig
    from engine.core.speculation_setup import Speculation

    cfg = cfg or SpecConfig()
    if cfg.method != "draft" or draft_lm is None:
        return Speculation.of(cfg)
    why = tokenizer_mismatch(draft_lm, target_lm) if check else ""
    if why:
        raise DraftMismatchError(f"draft model {draft_lm.info.name}: {why}")
    return Speculation(cfg, lambda: ModelDrafter(draft_lm, target_lm, check=False))
