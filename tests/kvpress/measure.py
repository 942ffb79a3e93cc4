"""``python -m tests.kvpress.measure [--needles 24] [--json FILE]``: the whole side-by-side table — our Expected
Attention, H2O and StreamingLLM at half and a quarter of the cache, in kvpress's protocol (the context read whole,
then evicted once) and as a chat reads (evicting as it goes), beside kvpress's presses of the same methods, their
per-layer variants and KVzip / Knorm for scale (with their prefill time against a plain prefill)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvpress_env  # noqa: E402
import side_by_side as sbs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "resources" / "models" / "stories260K"
KEEPS = (0.5, 0.25)
EXTRA = ("expected/layer", "observed/layer", "kvzip", "knorm")


def fmt(d: dict | None) -> str:
    if d is None:
        return "—"
    if "error" in d:
        return "error: " + d["error"][:50]
    out = f"ppl ×{d['perplexity_ratio']:.3f} · top-1 {100 * d['top1']:5.1f}% · KL {d.get('kl', 0):.3f}"
    return out + (f" · prefill ×{d['prefill_x']:.2f}" if "prefill_x" in d else "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--needles", type=int, default=24)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    import torch

    from engine.model.loader import load_model

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    lm = load_model(str(MODEL))
    items = sbs.texts(lm.tokenizer, a.needles)
    py = kvpress_env.ensure_venv(lambda m: print(f"[kvpress] {m}", file=sys.stderr))
    t0 = time.perf_counter()
    theirs = sbs.run_theirs(py, str(MODEL), items, KEEPS, extra=EXTRA)
    t1 = time.perf_counter()
    ours = (*sbs.METHODS, "expected/layer")
    once = sbs.run_ours(lm, items, KEEPS, ours, after_context=True)
    t2 = time.perf_counter()
    reading = sbs.run_ours(lm, items, KEEPS, ours, after_context=False)
    t3 = time.perf_counter()
    print(f"{len(items)} texts ({sum(t.kind == 'story' for t in items)} stories); kvpress {t1 - t0:.0f} s, ours "
          f"{t2 - t1:.0f} s + {t3 - t2:.0f} s (one thread each)")
    print(f"{'set':7s} {'method':15s} {'keep':5s} | {'ours, kvpress protocol':46s} | "
          f"{'ours, evicting as it reads':46s} | kvpress")
    keys = sorted(set(theirs) | set(once), key=lambda k: (k[0], k[1], -k[2]))
    for k in keys:
        print(f"{k[0]:7s} {k[1]:15s} {k[2]:<5} | {fmt(once.get(k)):46s} | {fmt(reading.get(k)):46s} | "
              f"{fmt(theirs.get(k))}")
    if a.json:
        flat = lambda d: {"|".join(map(str, k)): v for k, v in d.items()}  # noqa: E731
        Path(a.json).write_text(json.dumps({"kvpress": flat(theirs), "ours_kvpress_protocol": flat(once),
                                            "ours_as_it_reads": flat(reading)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
