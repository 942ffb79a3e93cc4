"""Runs inside the kvpress venv (``kvpress_env.py``): kvpress's presses on the same weights and token ids as our side.

Reads a job (JSON on stdin)::

    {"model": DIR, "threads": 1, "texts": [{"name", "ids", "context"}], "presses": [{"press", "ratio"}]}

For each text and press, kvpress's own protocol (its pipeline's): the context ``ids[:context]`` is prefilled with the
press on (compressed by ``ratio``: the fraction removed), then the rest of the text is fed in one forward at its
true positions over the compressed cache. The answer (JSON on stdout) has, per text, the full cache's log-probability
of each scored token and its top-1 ids, and per press the same under the press, and the prefill's time. Scored:
tokens ``context + 1 ..`` (the first continuation token is predicted by the prefill, before any compression).

Presses: ``expected`` (ExpectedAttentionPress), ``streaming`` (StreamingLLMPress), ``observed``
(ObservedAttentionPress: the H2O-like one, eager attention), ``knorm`` (KnormPress), ``kvzip`` (KVzipPress: context
reconstruction, ~2-3x the prefill); ``NAME/layer``: the same press choosing one set of tokens per layer (its KV
heads' scores summed), as KV Scope's paged cache does. Nothing from KV Scope is imported here.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def per_layer(press):
    """``press`` choosing one set of tokens for all KV heads of a layer (scores summed over the heads), as a cache
    with one block table per layer must: the same method at KV Scope's granularity."""
    base = type(press)

    class PerLayer(base):
        def score(self, *args, **kwargs):
            s = base.score(self, *args, **kwargs)  # [B, Hkv, n]
            return s.sum(dim=1, keepdim=True).expand_as(s).contiguous()

    PerLayer.__name__ = f"{base.__name__}PerLayer"
    layered = PerLayer.__new__(PerLayer)
    layered.__dict__.update(press.__dict__)
    return layered


def press_for(name: str, ratio: float):
    import kvpress

    if name.endswith("/layer"):
        return per_layer(press_for(name.removesuffix("/layer"), ratio))
    return {"expected": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
            "streaming": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
            "observed": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
            "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
            "kvzip": lambda: kvpress.KVzipPress(compression_ratio=ratio)}[name]()


def one(model, ids: list[int], context: int, press) -> tuple[torch.Tensor, float, int]:
    """Log-probs [m, V] of the continuation's predictions (tokens context+1..), the prefill's ms, tokens kept."""
    from transformers import DynamicCache

    x = torch.tensor([ids])
    cache = DynamicCache()
    t0 = time.perf_counter()
    if press is None:
        model.model(input_ids=x[:, :context], past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=x[:, :context], past_key_values=cache)
    ms = (time.perf_counter() - t0) * 1000.0
    kept = cache.get_seq_length()
    pos = torch.arange(context, len(ids))[None]
    out = model(input_ids=x[:, context:], past_key_values=cache, position_ids=pos)
    return torch.log_softmax(out.logits[0, :-1].float(), -1), ms, kept  # predicting ids[context + 1:]


def main() -> None:
    from transformers import AutoModelForCausalLM

    job = json.load(sys.stdin)
    torch.set_num_threads(int(job.get("threads", 1)))
    torch.set_grad_enabled(False)
    models = {impl: AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                         attn_implementation=impl).eval()
              for impl in ("sdpa", "eager")}
    out = {"texts": []}
    for text in job["texts"]:
        ids, n = text["ids"], text["context"]
        target = torch.tensor(ids[n + 1:])
        ref, ref_ms, _ = one(models["sdpa"], ids, n, None)
        row = {"name": text["name"], "reference": {"nll": (-ref.gather(1, target[:, None])[:, 0]).tolist(),
                                                   "top1": ref.argmax(-1).tolist(), "prefill_ms": ref_ms},
               "presses": []}
        for p in job["presses"]:
            model = models["eager" if p["press"].startswith("observed") else "sdpa"]
            try:
                lp, ms, kept = one(model, ids, n, press_for(p["press"], p["ratio"]))
            except Exception as e:  # noqa: BLE001 - a press that cannot run here is reported, the others go on
                row["presses"].append({**p, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            kl = (ref.exp() * (ref - lp)).sum(-1)
            row["presses"].append({**p, "nll": (-lp.gather(1, target[:, None])[:, 0]).tolist(),
                                   "top1": lp.argmax(-1).tolist(), "kl": kl.tolist(), "prefill_ms": ms,
                                   "kept": kept})
        out["texts"].append(row)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
