"""``python -m engine quality``: what each lossy cache setting costs in quality, on the same text.

For every setting the text is fed one token at a time through a ``ChatSession`` with that cache (so
quantization and eviction act exactly as during generation) and compared with the full-precision cache:

- perplexity of the text (teacher-forced);
- top-1 agreement: how often the setting's most likely next token equals the full cache's;
- greedy match: how many tokens a greedy continuation of the text's opening stays identical;
- KV bytes per cached token at the end (codes + scales for quantized pages).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.config import CacheConfig, SamplingConfig, value_dtype
from engine.policies.base import config_from_flags

if TYPE_CHECKING:
    import torch  # imported where used: a refused flag or --text file exits in 0.2 s, not after torch's 1.7 s

DEFAULT_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, "
    "she saw a big red ball in the park. She ran to the ball and picked it up. A small boy named Tim came "
    "to her and said, \"That is my ball. Can I have it back, please?\" Lily felt sad because she wanted to "
    "play with the ball, but she knew it was not hers. She gave the ball to Tim and said, \"Here you go.\" "
    "Tim smiled and said, \"Thank you! Do you want to play with me?\" Lily was very happy. They played with "
    "the ball all day long. They threw it high in the sky and ran after it. When the sun went down, Lily's "
    "mom called her home. Lily said goodbye to Tim and went home. She told her mom about her new friend. "
    "Her mom was proud of her for being kind. The next day, Lily went back to the park. Tim was there with "
    "his dog, Max. Max was a big brown dog who liked to jump and bark. Lily and Tim played with Max and the "
    "ball. Max ran very fast and caught the ball in his mouth. Everyone laughed. Then it started to rain. "
    "Lily, Tim and Max ran under a big tree. They sat together and watched the rain fall on the grass. "
    "When the rain stopped, they saw a rainbow in the sky. It was red, yellow, green and blue. Lily said, "
    "\"Look, a rainbow! It is so pretty.\" Tim said, \"Yes, it is the best day ever.\" They were happy "
    "friends, and they played in the park every day after that. The end."
)


@dataclass
class Setting:
    k_dtype: str = "auto"
    v_dtype: str = "auto"
    policy: str = "none"
    params: dict[str, Any] = field(default_factory=dict)
    page_size: int = 16
    fraction: float | None = None  # an eviction policy's budget as a fraction of the text (the row says so)

    def cache(self) -> CacheConfig:
        return CacheConfig(mode="paged", page_size=self.page_size, k_dtype=self.k_dtype, v_dtype=self.v_dtype,
                           policy=self.policy, policy_params=dict(self.params))

    def label(self) -> str:
        kv = self.k_dtype if self.k_dtype == self.v_dtype else f"K:{self.k_dtype} V:{self.v_dtype}"
        pol = self.policy if self.policy == "none" else f"{self.policy}({', '.join(f'{k}={v}' for k, v in self.params.items())})"
        return f"{kv} {pol}"


def teacher_forced(lm, setting: Setting, ids: list[int]) -> tuple[torch.Tensor, int, int]:
    """Logits [T-1, vocab] predicting ids[1:], plus the KV bytes and tokens held at the end."""
    import torch

    from engine.core.session import ChatSession

    from engine.core.teacher import teacher_force_chunks

    s = ChatSession(lm, setting.cache())
    try:
        # every token sees the cache as decoding it would (evicting and quantizing as during a reply), in the
        # fewest forwards that keep it so
        rows = [logits.float().cpu() for _, logits in teacher_force_chunks(s, ids[:-1])]
        snap = s.snapshot()
        return torch.cat(rows), snap.kv_bytes, int(snap.tokens_per_layer.max())
    finally:
        s.close()


def greedy(lm, setting: Setting, prompt: list[int], n: int) -> list[int]:
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession

    s = ChatSession(lm, setting.cache())
    s.start_ids(prompt, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    try:
        for _ in drive(s):
            pass
        return s.generated_ids
    finally:
        s.close()


def score(lm, ids: list[int], settings: list[Setting], greedy_prompt: int = 32, greedy_tokens: int = 200,
          log=lambda *a: None) -> dict[str, Any]:
    import torch

    ref_set = Setting()
    ref_logits, ref_bytes, ref_tokens = teacher_forced(lm, ref_set, ids)
    target = torch.tensor(ids[1:])
    ref_nll = torch.nn.functional.cross_entropy(ref_logits, target).item()
    ref_top1 = ref_logits.argmax(-1)
    prompt = ids[:greedy_prompt]
    room = lm.info.context_length - len(prompt) - 1
    n_greedy = max(1, min(greedy_tokens, room))
    ref_greedy = greedy(lm, ref_set, prompt, n_greedy)
    out = {
        "reference": {"perplexity": round(math.exp(ref_nll), 4), "tokens": len(ids),
                      "kv_bytes_per_token": round(ref_bytes / max(1, ref_tokens), 2)},
        "rows": [],
    }
    log(f"reference: perplexity {math.exp(ref_nll):.4f} over {len(ids)} tokens")
    for st in settings:
        logits, kv_bytes, tokens = teacher_forced(lm, st, ids)
        nll = torch.nn.functional.cross_entropy(logits, target).item()
        agree = (logits.argmax(-1) == ref_top1).float().mean().item()
        gen = greedy(lm, st, prompt, n_greedy)
        match = next((i for i, (a, b) in enumerate(zip(gen, ref_greedy)) if a != b), min(len(gen), len(ref_greedy)))
        row = {
            "kv_dtype": st.k_dtype if st.k_dtype == st.v_dtype else f"K:{st.k_dtype} V:{st.v_dtype}",
            "k_dtype": st.k_dtype, "v_dtype": st.v_dtype,
            "policy": st.policy, "params": st.params,
            "perplexity": round(math.exp(nll), 4),
            "perplexity_ratio": round(math.exp(nll - ref_nll), 4),
            "top1_agreement": round(agree, 4),
            "greedy_match_tokens": match, "greedy_tokens": n_greedy,
            "kv_bytes_per_token": round(kv_bytes / max(1, tokens), 2),
            "kv_bytes_per_token_ratio": round((kv_bytes / max(1, tokens)) / (ref_bytes / max(1, ref_tokens)), 4),
            "kv_tokens_held": tokens,
        }
        if st.fraction is not None:
            row["cache_fraction"] = st.fraction
        out["rows"].append(row)
        log(f"{st.label():40s} ppl {row['perplexity']:9.4f} (×{row['perplexity_ratio']:.4f})  top1 "
            f"{row['top1_agreement'] * 100:6.2f}%  greedy {match:4d}/{n_greedy}  KV B/tok "
            f"{row['kv_bytes_per_token']:8.1f} (×{row['kv_bytes_per_token_ratio']:.3f})")
    return out


def default_settings(n_tokens: int, ctx: int, page_size: int = 16) -> list[Setting]:
    window = min(256, ctx - 8)
    settings = [
        Setting("int8", "int8"),
        Setting("int4", "int4"),
        Setting("int8", "auto"),
        Setting("auto", "int4"),
        Setting("tq4", "tq4"),  # rotated low-bit (TurboQuant-class), engine.kv.quantized.tq_schemes
        Setting("tq3", "tq3"),
        Setting("tq2", "tq2"),
        Setting("tq3-qjl", "tq3"),  # keys with the QJL residual, at the same 3 bits a coordinate
        *policy_settings(n_tokens),
        Setting("int8", "int8", policy="streaming", params={"sinks": 4, "window": window}),
    ]
    for st in settings:
        st.page_size = page_size  # --page-size applies to every row, not only to one asked-for setting
    return settings


def policy_settings(n_tokens: int, fractions=(0.5, 0.25)) -> list[Setting]:
    """StreamingLLM, H2O, Expected Attention and priority each keeping half and a quarter of the text (H2O and
    Expected Attention with the same recent window, a quarter of the budget)."""
    out = []
    for frac in fractions:
        keep = max(8, int(n_tokens * frac))
        recent = max(4, keep // 4)
        out += [Setting(policy="streaming", params={"sinks": 4, "window": keep - 4}, fraction=frac),
                Setting(policy="h2o", params={"budget": keep, "recent": recent}, fraction=frac),
                Setting(policy="expected", params={"budget": keep, "recent": recent}, fraction=frac),
                Setting(policy="priority", params={"budget": keep, "recent": recent}, fraction=frac)]
    return out


def _one_setting(a) -> Setting | None:
    """The single setting the flags ask for (checked before the model loads), or None for the default set."""
    if not (a.kv_dtype or a.k_dtype or a.v_dtype or a.policy != "none"):
        return None
    from engine.policies import policy_flags

    cfg = config_from_flags(policy=a.policy, flags={f: getattr(a, f, None) for f in policy_flags()},
                                 page_size=a.page_size, k_dtype=a.k_dtype or a.kv_dtype or "auto",
                                 v_dtype=a.v_dtype or value_dtype(a.kv_dtype or "auto"))
    return Setting(cfg.k_dtype, cfg.v_dtype, cfg.policy, dict(cfg.policy_params), cfg.page_size)


def run_quality(a) -> int:
    from engine.tools.arguments import write_json
    from engine.inputs import read_text

    # every flag and the text file before the model loads: --page-size 0 is generate's one-line refusal,
    # and --text /dev/zero (read whole, it grew to 23.9 GB) or a FIFO (blocked forever) one line, exit 2
    CacheConfig(page_size=a.page_size)
    one = _one_setting(a)
    text = DEFAULT_TEXT if a.text is None else read_text(a.text, "--text file", hint="give a UTF-8 text file")
    import torch

    from engine.config import ModelSpec
    from engine.model.loader import load_model
    from engine.model.notes import print_notes

    lm = load_model(ModelSpec(source=a.model, device=a.device), print_notes)  # the memory verdict, on stderr
    if lm.tokenizer is None:
        raise ValueError("quality needs a model with a tokenizer")
    ids = [int(t) for t in lm.tokenizer(text)["input_ids"]]
    ctx = lm.info.context_length
    if len(ids) > ctx - 1:
        ids = ids[: ctx - 1]  # the full-cache reference must fit the context
    if len(ids) < 16:
        raise ValueError(f"text too short ({len(ids)} tokens): give at least 16")
    settings = [one] if one is not None else default_settings(len(ids), ctx, a.page_size)
    torch.set_grad_enabled(False)
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    out = score(lm, ids, settings, log=log)
    out["model"] = a.model
    write_json(a.json_file, out)
    return 0
