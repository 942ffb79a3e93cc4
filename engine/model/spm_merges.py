"""The merges a SentencePiece vocabulary implies, for a GGUF that lists none (Phi-3, Llama-2, Gemma: transformers
builds a BPE tokenizer from them), computed as ``transformers.tokenization_utils_base.generate_merges`` computes
them, in the same order, with its per-pair Python sort keys replaced by plain tuples.

Why: it runs Python code per split and sorts with a lambda per token and per pair: 0.11-0.13 s for Phi-3's and
Llama-2's vocabularies (32,064 tokens, 61,249 pairs) of a 0.2 s load here, where llama.cpp opens the same file in
0.04 s; this takes 0.065-0.08 (Gemma's 262,144 tokens: 1.4 s -> 1.1, its 2.4M lookups of new strings' hashes).
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import repeat
from operator import itemgetter

import numpy as np


# characters the splits may copy: real vocabularies cut 0.9M (Phi-3's) to 9.4M (Gemma's 262,144 tokens); a file's
# tokens could make it quadratic in their length (transformers' own cuts every token at every length)
MAX_CUT_CHARACTERS = 1 << 28


def generate_merges(vocab: dict[str, int], vocab_scores: dict[str, float] | None = None,
                    skip_tokens: Collection[str] | None = None) -> list[tuple[str, str]]:
    """transformers' ``generate_merges``: every split of every token into two tokens of ``vocab``, ordered by
    (score, left length, right length) — best first where ``vocab_scores`` is given — ties in the order the tokens
    come (its ``sorted(..., reverse=True)`` is stable). Its per-token sort by the pieces' ids never decides: a
    token's splits differ in their left length. The splits are cut one length at a time over the tokens that may split
    there, looked up by ``map`` (no Python code per split), and ordered by one ``numpy.lexsort``. ValueError where
    the cuts would copy over ``MAX_CUT_CHARACTERS`` (a file's tokens made long to stall the load)."""
    if skip_tokens or min(vocab.values(), default=0) < 0:  # no GGUF builder passes either (-1: not a token)
        from transformers.tokenization_utils_base import generate_merges as real

        return real(vocab, vocab_scores, skip_tokens)
    reverse = vocab_scores is not None
    scores = dict(vocab_scores) if reverse else vocab
    tokens = list(scores)  # the order the splits are found in (ties keep it)
    n = len(tokens)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=n)  # [n]
    # the lengths a piece can have: a split at i of a token of length L is a pair only if some token is i long and
    # some L - i (so a file's one 8 MB token is cut at a few lengths, not 8 million)
    held = np.unique(np.fromiter(map(len, vocab), dtype=np.int64, count=len(vocab)))  # [distinct lengths]
    found, cuts, get, work = [], [], vocab.get, 0
    for i in held[held > 0].tolist():
        at = np.flatnonzero((lengths > i) & np.isin(lengths - i, held))  # [m] the tokens that may split at i
        work += int(lengths[at].sum())
        if work > MAX_CUT_CHARACTERS:
            raise ValueError(f"its vocabulary's tokens are too long to derive merges from (over "
                             f"{MAX_CUT_CHARACTERS:,} characters cut)")
        long = [tokens[j] for j in at.tolist()]
        left = np.fromiter(map(get, map(itemgetter(slice(None, i)), long), repeat(-1)), np.int64, len(long))  # [m]
        right = np.fromiter(map(get, map(itemgetter(slice(i, None)), long), repeat(-1)), np.int64, len(long))  # [m]
        hit = at[(left >= 0) & (right >= 0)]  # [k] tokens that split into two tokens at i
        found.append(hit)
        cuts.append(np.full(hit.shape[0], i, dtype=np.int64))
    if not found:
        return []
    where, cut = np.concatenate(found), np.concatenate(cuts)  # [pairs]
    score = np.asarray(list(scores.values()))[where]  # [pairs] float (a file's scores) or int (ids, positions)
    rest = lengths[where] - cut
    keys = (where, -rest, -cut, -score) if reverse else (where, rest, cut, score)  # lexsort: the last key first
    order = np.lexsort(keys)
    return [(tokens[t][:i], tokens[t][i:]) for t, i in zip(where[order].tolist(), cut[order].tolist())]
