"""Our eviction policies beside kvpress's presses of the same method, on the same weights (stories260K) and the
same token ids: held-out stories and a needle-retrieval prompt set built here.

Protocol (kvpress's own, its pipeline's): a text's context ``ids[:N]`` is read with the method keeping a fraction
``keep`` of it (kvpress: ``compression_ratio = 1 - keep``, once, after the prefill), then the rest of the text is
fed; scored are the tokens from ``N + 1`` on (the first one is predicted before any compression), against the
full cache of the same implementation: perplexity ratio, top-1 agreement, KL. Needles: a name introduced once
("a friend named Zoe") at a depth in filler, asked for at the end ("... her friend named"), scored on the name's
tokens after its first (the part a model copies).

Ours reads the same text through a ``ChatSession`` (``teacher_force_chunks``: as decoding would) with a budget of
``keep * N + M / 2`` tokens (M: the continuation's tokens; kvpress's cache grows from ``keep * N`` to
``keep * N + M`` over the continuation: the same on average) and pages of 4 (evicting up to 4 tokens at once).
Where the methods differ (said in the report): ours evicts as it reads (each eviction scored from the recent
queries), keeps a recent window, and StreamingLLM re-rotates kept keys; kvpress compresses once after the whole
context, from all the prompt's queries. Expected Attention keeps its tokens per KV head in both; "expected/layer"
is ours with a layer's heads keeping one set (their scores summed), beside kvpress's per-layer variant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STORY_2 = (
    "Tom had a little red boat. Every day he took it to the pond near his house. He liked to watch it float on the "
    "water. One day the wind was very strong. The boat went far away from Tom. Tom was sad and he started to cry. "
    "His friend Sue saw him and asked, \"Why are you sad, Tom?\" Tom said, \"My boat went away and I cannot get "
    "it.\" Sue had an idea. She found a long stick under a big tree. She gave the stick to Tom. Tom used the stick "
    "to pull the boat back to the shore. He was so happy! \"Thank you, Sue!\" he said. They played with the boat "
    "together all afternoon. When the sun went down, they sat on the grass and ate apples. Sue said, \"Today was "
    "fun.\" Tom smiled and said, \"You are a good friend.\" The next day, Tom and Sue went back to the pond. This "
    "time they tied a string to the boat, so the wind could not take it away. The boat sailed round and round, and "
    "the ducks swam next to it. A big frog jumped on the boat and sat there like a captain. Tom and Sue laughed "
    "and laughed. From that day on, the frog came every day to ride the little red boat."
)
FILLER = ("The sun was warm and the sky was blue. The birds sang in the trees and the flowers were pretty. "
          "A little dog ran in the grass and a cat sat on the wall. The wind was soft and the day was long. "
          "Mom made a cake and the kitchen smelled sweet. The children played with a ball in the yard. ")
NAMES = ("Zoe", "Kitty", "Ducky", "Lucy", "Jack", "Anna", "Spot", "Bob")
CONTINUATION = 32  # tokens after a story's context
RECENT = 4  # our Expected Attention's recent window here (kvpress's press keeps none; 1 read the stories worse)
METHODS = {"expected": "expected", "h2o": "observed", "streaming": "streaming"}  # ours → kvpress's press


@dataclass(frozen=True)
class Text:
    name: str
    ids: tuple[int, ...]
    context: int
    kind: str  # "story" | "needle"


def texts(tokenizer, needles: int = 24) -> list[Text]:
    from engine.tools.quality import DEFAULT_TEXT

    out = []
    for i, story in enumerate((DEFAULT_TEXT, STORY_2)):
        ids = [int(t) for t in tokenizer(story)["input_ids"]][:448]
        out.append(Text(f"story {i + 1}", tuple(ids), len(ids) - CONTINUATION, "story"))
    for k in range(needles):
        depth, name = k // len(NAMES) % 3, NAMES[k % len(NAMES)]
        pre = f"Once upon a time, there was a girl who had a friend named {name}. "
        head = FILLER * depth + pre + FILLER * (3 - depth) + "The girl went to play with her friend named"
        q = [int(t) for t in tokenizer(head)["input_ids"]]
        ids = [int(t) for t in tokenizer(head + " " + name)["input_ids"]]
        out.append(Text(f"needle {name} at depth {depth}", tuple(ids), len(q), "needle"))
    return out


def our_config(method: str, keep: float, text: Text):
    from engine.config import CacheConfig

    method, _, layer = method.partition("/")  # "expected/layer": a layer's heads keep one set (``per_head`` off)
    m = len(text.ids) - text.context
    budget = max(8, round(keep * text.context) + m // 2)
    params = {"expected": {"budget": budget, "recent": RECENT, "sinks": 4},  # kvpress: sinks, no recent window
              "h2o": {"budget": budget, "recent": budget // 2},  # the H2O paper's half heavy hitters, half recent
              "streaming": {"sinks": 4, "window": budget - 4}}[method]
    if layer:
        params["per_head"] = False
    return CacheConfig(mode="paged", page_size=4, policy=method, policy_params=params, prefix_reuse=False)


def our_logprobs(lm, cfg, text: Text, after_context: bool = False):
    """Log-probs [m, V] predicting ``ids[context + 1:]`` through a session under ``cfg`` (None: the full cache).
    ``after_context``: kvpress's protocol — the context read with nothing evicted (the policy's budget above it),
    then the budget set to ``cfg``'s between two steps (the policy evicts at once, from what it saw of the whole
    context), then the rest fed; else the policy evicts as it reads, as during a chat."""
    import torch

    from engine.config import CacheConfig
    from engine.core.session import ChatSession
    from engine.core.teacher import teacher_force_chunks

    full = CacheConfig(mode="paged", page_size=4, prefix_reuse=False)
    if cfg is None or not after_context:
        s = ChatSession(lm, cfg or full)
        rows = list(teacher_force_chunks(s, text.ids))
    else:
        roomy = dict(cfg.policy_params)
        roomy["budget" if "budget" in roomy else "window"] = lm.info.context_length - 8
        if cfg.policy == "expected":
            roomy["queries"] = text.context  # every query of the context, as kvpress's press reads them
        s = ChatSession(lm, cfg.replace(policy_params=roomy))
        rows = list(teacher_force_chunks(s, text.ids[:text.context]))
        s.apply(cfg.replace(policy_params={**cfg.policy_params, **({"queries": text.context}
                                                                   if cfg.policy == "expected" else {})}))
        rows += list(teacher_force_chunks(s, text.ids[text.context:], start_over=False))
    s.close()
    logits = torch.cat([lg.float() for _, lg in rows])  # [T, V]: position p predicts ids[p + 1]
    return torch.log_softmax(logits[text.context:len(text.ids) - 1], -1)


def scores(ref_nll, ref_top, nll, top, kl=None) -> dict:
    """Perplexity ratio, top-1 agreement and mean KL over the scored tokens of a set of texts."""
    n = len(nll)
    out = {"tokens": n, "perplexity_ratio": math.exp(sum(nll) / n - sum(ref_nll) / n),
           "nll": sum(nll) / n, "top1": sum(int(a == b) for a, b in zip(top, ref_top)) / n}
    if kl is not None:
        out["kl"] = sum(kl) / n
    return out


def run_ours(lm, items: list[Text], keeps, methods=tuple(METHODS), after_context: bool = True) -> dict:
    """{(kind, method, keep): scores} (``after_context``: kvpress's protocol; else evicting as it reads)."""
    import torch

    acc: dict = {}
    for text in items:
        target = torch.tensor(text.ids[text.context + 1:])
        ref = our_logprobs(lm, None, text)
        for method in methods:
            for keep in keeps:
                lp = our_logprobs(lm, our_config(method, keep, text), text, after_context)
                kl = (ref.exp() * (ref - lp)).sum(-1)
                a = acc.setdefault((text.kind, method, keep), [[], [], [], [], []])
                a[0] += (-ref.gather(1, target[:, None])[:, 0]).tolist()
                a[1] += ref.argmax(-1).tolist()
                a[2] += (-lp.gather(1, target[:, None])[:, 0]).tolist()
                a[3] += lp.argmax(-1).tolist()
                a[4] += kl.tolist()
    return {k: scores(*v) for k, v in acc.items()}


def run_theirs(py, model_dir: str, items: list[Text], keeps, methods=tuple(METHODS), extra=()) -> dict:
    """The same through kvpress in its venv: {(kind, method, keep): scores} (``extra``: more kvpress presses by
    their own names, e.g. "kvzip"), plus the prefill time ratio of each press to the plain prefill."""
    from kvpress_env import run

    presses = [{"press": METHODS.get(m, m), "ratio": 1.0 - k, "ours": m, "keep": k}
               for m in (*methods, *extra) for k in keeps]
    job = {"model": model_dir, "threads": 1,
           "texts": [{"name": t.name, "ids": list(t.ids), "context": t.context} for t in items],
           "presses": [{"press": p["press"], "ratio": p["ratio"]} for p in presses]}
    answer = run(py, job)
    acc: dict = {}
    ms: dict = {}
    for text, row in zip(items, answer["texts"]):
        ref = row["reference"]
        for p, got in zip(presses, row["presses"]):
            key = (text.kind, p["ours"], p["keep"])
            if got.get("error"):
                acc[key] = got["error"]
                continue
            a = acc.setdefault(key, [[], [], [], [], []])
            a[0] += ref["nll"]
            a[1] += ref["top1"]
            a[2] += got["nll"]
            a[3] += got["top1"]
            a[4] += got["kl"]
            m = ms.setdefault(key, [0.0, 0.0])
            m[0] += got["prefill_ms"]
            m[1] += ref["prefill_ms"]
    out = {k: (scores(*v) if not isinstance(v, str) else {"error": v}) for k, v in acc.items()}
    for k, (press_ms, plain_ms) in ms.items():
        out[k]["prefill_x"] = press_ms / max(plain_ms, 1e-9)
    return out
