"""The closing note's decode measure for the quantized precisions: decode tok/s with K and V as int8, int4, tq4, tq3,
tq2 and tq3-qjl keys, each ÷ full precision, on the SmolLM2-135M shape at 2,048 tokens of context, in one run.

``engine bench --shape smollm2-135m --contexts 2048 --modes paged,paged:tq4,...`` prefills 2,048 tokens once per mode
and repeat (on this shared 2-core machine at load ~13 that took over 25 minutes for no row); here one chat is
prefilled once and its precision switched mid-reply (``ChatSession.apply`` quantizes or dequantizes the pages, as in
the app) between segments of decoding, rounds interleaved: full, int4, tq4, tq3, tq2, tq3-qjl, full, ... Each
segment's first step (the one after the switch) is not timed. ``--both-reads`` adds tq4 and tq3 read in the original
basis (every cached token turned back, ``KVSCOPE_ROTATED_READS=off``) to the same rounds; ``--int8-torch`` adds int8
read back without the fused kernel (the linears' native product stays).

Run: ``python tests/engine/measure_tq_decode.py [--rounds 3] [--tokens 12] [--context 2048] [--both-reads]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SETTINGS = (("auto", "auto"), ("int8", "int8"), ("int4", "int4"), ("tq4", "tq4"), ("tq3", "tq3"), ("tq2", "tq2"),
            ("tq3-qjl", "tq3"))
ORIGINAL = (("tq4", "tq4"), ("tq3", "tq3"))  # --both-reads: these again with every cached token turned back


def main(argv: list[str]) -> int:
    import torch

    from engine.config import CacheConfig, SamplingConfig
    from engine.core.session import ChatSession
    from engine.model.fast_step import FastStep
    from engine.model import runner
    from engine.model.shapes import build_shape

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--json", dest="json_file")
    p.add_argument("--both-reads", action="store_true", help="also tq4 and tq3 read in the original basis")
    p.add_argument("--int8-torch", action="store_true", help="also int8 read back without the fused kernel")
    a = p.parse_args(argv)
    plan = [(k, v, "") for k, v in SETTINGS] + ([(k, v, "/original") for k, v in ORIGINAL] if a.both_reads else [])
    plan += [("int8", "int8", "/torch")] if a.int8_torch else []
    from engine.kv.quantized import tq_attend

    fused_attend = tq_attend.attend
    a.rotated = runner.ROTATED_READS  # KVSCOPE_ROTATED_READS=off: every tq row reads in the original basis
    torch.set_grad_enabled(False)
    lm = build_shape("smollm2-135m")
    lm.runner.fast = FastStep(lm, mode="off")  # every setting on the eager step (the compiled one takes only full)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, lm.info.vocab_size, (a.context,), generator=g).tolist()
    n_steps = len(plan) * a.rounds * (a.tokens + 1) + 4
    s = ChatSession(lm, CacheConfig(page_size=16))
    s.start_ids(prompt, SamplingConfig(max_new_tokens=n_steps, ignore_eos=True))
    s.step()  # the prefill
    times: dict[str, list[float]] = {f"{k}/{v}{how}": [] for k, v, how in plan}
    for _ in range(a.rounds):
        for k, v, how in plan:
            runner.ROTATED_READS = how != "/original" and a.rotated
            tq_attend.attend = (lambda *args: None) if how == "/torch" else fused_attend  # pages read back instead
            s.apply(CacheConfig(page_size=16, k_dtype=k, v_dtype=v))
            s.step()  # the first step after a switch: not timed
            t0 = time.perf_counter()
            for _ in range(a.tokens):
                s.step()
            times[f"{k}/{v}{how}"].append(a.tokens / (time.perf_counter() - t0))
    s.close()
    full = statistics.median(times["auto/auto"])
    rows = [{"k_dtype": key.split("/")[0], "v_dtype": key.split("/")[1],
             "reads": key.split("/")[2] if key.count("/") == 2 else "rotated",
             "decode_tokens_per_s": round(statistics.median(r), 2), "ratio_to_full": round(statistics.median(r) / full, 3),
             "rounds": [round(x, 2) for x in r]} for key, r in times.items()]
    print(f"SmolLM2-135M shape, context {a.context}, {a.rounds} rounds of {a.tokens} tokens, threads "
          f"{torch.get_num_threads()}")
    for r in rows:
        print(f"  K {r['k_dtype']:8s} V {r['v_dtype']:5s} reads {r['reads']:8s} {r['decode_tokens_per_s']:7.2f} tok/s  "
              f"×{r['ratio_to_full']:.3f}")
    if a.json_file:
        with open(a.json_file, "w") as f:
            json.dump({"rows": rows, "context": a.context}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
