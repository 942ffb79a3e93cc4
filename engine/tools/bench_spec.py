"""Speculative rows for ``python -m engine bench``: ``--speculative ngram|draft:PATH`` pairs every engine row (paged,
contiguous) with a speculative one (``"speculative"``: null on the plain row, the drafter on its pair), and
``--scenario copy`` times a prompt that holds a passage the reply repeats (prompt lookup's best case).
"""

from __future__ import annotations

from typing import Any

import torch

SUFFIX = "+spec"


def setup(a, lm) -> None:
    """Parse ``--speculative`` and load a draft model once (``a.spec_cfg``, ``a.draft_lm``)."""
    from engine.core.verify import SpecConfig

    a.spec_cfg = SpecConfig.parse(getattr(a, "speculative", "off"), getattr(a, "draft_tokens", 0))
    a.draft_lm = None
    if a.spec_cfg.method == "draft":
        from engine.config import ModelSpec
        from engine.model.loader import load_model
        from engine.speculation.draft_model import tokenizer_mismatch

        a.draft_lm = load_model(ModelSpec(source=a.spec_cfg.draft_path, device=lm.device.type))
        if lm.tokenizer is None:  # a --shape model: the draft must at least share the vocabulary
            if a.draft_lm.info.vocab_size > lm.info.vocab_size:
                raise ValueError(f"draft model: its vocabulary ({a.draft_lm.info.vocab_size}) is larger than the "
                                 f"model's ({lm.info.vocab_size})")
        elif why := tokenizer_mismatch(a.draft_lm, lm):
            raise ValueError(f"draft model {a.draft_lm.info.name}: {why}")


def with_spec(a, modes: list[str]) -> list[str]:
    """``modes`` and, with ``--speculative``, a speculative twin of each paged / contiguous mode."""
    cfg = getattr(a, "spec_cfg", None)
    if cfg is None or cfg.method == "off":
        return modes
    return modes + [m + SUFFIX for m in modes if m.partition(":")[0] in ("paged", "contiguous")]


def speculate(session, a, lm) -> None:
    """Turn the session's speculation on as ``--speculative`` says (a fresh draft cache per run)."""
    from engine.speculation.draft_model import ModelDrafter

    cfg = a.spec_cfg
    drafter = ModelDrafter(a.draft_lm, lm, check=False) if cfg.method == "draft" else None  # checked in ``setup``
    session.speculate(cfg, drafter)


def fields(stats, label: str) -> dict[str, Any]:
    """A speculative run's counts for its row."""
    return {"speculative": label, "draft_tokens": stats.draft_tokens,
            "accepted_draft_tokens": stats.accepted_draft_tokens, "forwards": stats.forwards,
            "tokens_per_forward": round(stats.generated_tokens / stats.forwards, 3) if stats.forwards else None,
            "accepted_by_position": list(stats.accepted_by_position)}


def copy_prompt(lm, new_tokens: int) -> list[int]:
    """A prompt that holds a passage and then starts it again, so the reply repeats it — as an instruct model asked
    to repeat a passage with small changes does. The passage is the model's own greedy text after the opening
    (a model that follows no instruction, tiny or random-weight, then repeats it too), as long as the context
    allows with ``new_tokens`` after the prompt."""
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession
    from engine.config import SamplingConfig, CacheConfig

    tok = lm.tokenizer
    if tok is not None:
        opening = tok("Once upon a time, there was", add_special_tokens=True)["input_ids"]
    else:
        g = torch.Generator().manual_seed(11)
        opening = torch.randint(3, lm.info.vocab_size, (8,), generator=g).tolist()
    room = lm.info.context_length - new_tokens - 2 * len(opening) - 8
    length = max(16, min(1024, room))
    s = ChatSession(lm, CacheConfig(prefix_reuse=False))
    try:
        s.start_ids(opening, SamplingConfig(max_new_tokens=length, ignore_eos=True))
        for _ in drive(s):
            pass
        passage = s.generated_ids
    finally:
        s.close()
    return opening + passage + opening


def fields_median(runs: list[dict]) -> dict[str, Any]:
    """A speculative row's counts: the last repeat's (greedy runs repeat the same drafts)."""
    keys = ("speculative", "draft_tokens", "accepted_draft_tokens", "forwards", "tokens_per_forward",
            "accepted_by_position")
    return {k: runs[-1][k] for k in keys if k in runs[-1]}


def copy_rows(lm, a, measure, rows_of, log) -> list[dict]:
    """``--scenario copy``: the copy prompt through every mode (each with its speculative twin), one row each."""
    prompt = copy_prompt(lm, a.new_tokens)
    lm.runner.spec_verdicts.clear()  # whether speculation pays is found out afresh on this prompt
    modes = getattr(a, "bench_modes", [])
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:
            results[m].append(measure(lm, a, m, prompt, a.new_tokens))
    log(f"  copy scenario: a {len(prompt)}-token prompt that repeats a passage")
    return rows_of(a, len(prompt), a.new_tokens, results, log, kind="copy")
