"""GGUF files with their blocks kept (``engine.quant``) against llama.cpp on the same files: load time, RSS after
load, peak RSS, time to first token and decode speed, one fresh process per side and round, sides interleaved.

    python tests/engine/measure_gguf_blocks.py --llama-python PYTHON_WITH_LLAMA_CPP FILE.gguf [FILE.gguf ...]
        [--threads 1,2] [--contexts 128,1024] [--new 32] [--rounds 2] [--json out.json]

The prompt is token ids (no tokenizer: ``(7 i) % 500 + 3``, a BOS first), the same on both sides; decode is one
token's forward a step on both (the engine's greedy tokens, llama.cpp fed fixed ids through
``Llama.eval``). The engine's compiled decode step is started as the app starts it (its package,
built once per shape by a background child, loads from the cache; its first 32 steps are the 3:1 trial). llama.cpp runs through llama-cpp-python (``--llama-python``: a Python with
``llama_cpp``), memory-mapped as it loads by default, flash attention on; ``LC_NO_EXTRA_BUFTS=1`` turns off its
repacked weight buffers (where they fault). Not in the default suite (minutes per file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def prompt(ctx: int) -> list[int]:
    return [1] + [(i * 7) % 500 + 3 for i in range(ctx - 1)]


def child_kvscope(path: str, threads: int, ctx: int, new: int) -> dict:
    import resource

    import torch

    sys.path.insert(0, str(ROOT))
    from engine.config import CacheConfig, ModelSpec, SamplingConfig
    from engine.core.session import ChatSession
    from engine.model.loader import load_model

    t0 = time.perf_counter()
    lm = load_model(ModelSpec(source=path))
    load_s = time.perf_counter() - t0
    torch.set_num_threads(threads)
    rss_load = _rss_mb()
    lm.fast.start()  # as the app does at load: a package already built for this shape loads in milliseconds
    lm.fast.wait(60)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16))
    t0 = time.perf_counter()
    s.start_ids(prompt(ctx), SamplingConfig(max_new_tokens=new, ignore_eos=True))
    r = s.step()
    ttft = time.perf_counter() - t0
    paths: dict[str, int] = {}
    t1 = time.perf_counter()
    while not (r := s.step()).done:
        if r.event is not None:
            paths[r.event.path] = paths.get(r.event.path, 0) + 1
    dec = time.perf_counter() - t1
    return dict(load_s=load_s, rss_load_mb=rss_load, ttft_s=ttft, decode_tok_s=(new - 1) / dec,
                peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, tokens=s.generated_ids[:8],
                kernel=lm.info.weights_kernel, steps=" ".join(f"{k} {v}" for k, v in sorted(paths.items())),
                fast=lm.fast_step.describe() if lm.fast_step is not None else "")


def child_llama(path: str, threads: int, ctx: int, new: int) -> dict:
    import resource

    import llama_cpp
    import llama_cpp.llama as ll

    if os.environ.get("LC_NO_EXTRA_BUFTS"):
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p
        ll.llama_cpp.llama_model_default_params = params
    t0 = time.perf_counter()
    # the engine's paged pool starts at min(context, 2048) tokens: llama.cpp's cache sized alike
    llm = llama_cpp.Llama(model_path=path, n_ctx=max(2048, ctx + new + 16), n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, flash_attn=True, logits_all=False)
    load_s = time.perf_counter() - t0
    rss_load = _rss_mb()
    t0 = time.perf_counter()
    llm.eval(prompt(ctx))
    ttft = time.perf_counter() - t0
    tok, toks = 5, []  # fixed ids, as lc.py feeds them: one token's forward each, as the engine's greedy step
    t1 = time.perf_counter()
    for _ in range(new - 1):
        llm.eval([tok])
        toks.append(tok)
        tok = (tok * 13 + 7) % 500 + 3
    dec = time.perf_counter() - t1
    return dict(load_s=load_s, rss_load_mb=rss_load, ttft_s=ttft, decode_tok_s=(new - 1) / dec,
                peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, tokens=toks[:8])


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run(python: str, side: str, path: str, threads: int, ctx: int, new: int) -> dict:
    env = dict(os.environ, KVSCOPE_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    r = subprocess.run([python, __file__, "--child", side, path, str(threads), str(ctx), str(new)],
                       capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        return dict(error=(r.stderr.strip().splitlines() or ["?"])[-1][:300])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=5)
    ap.add_argument("--llama-python", default="")
    ap.add_argument("files", nargs="*")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--contexts", default="128")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.child:
        side, path, threads, ctx, new = a.child
        fn = child_kvscope if side == "kvscope" else child_llama
        print(json.dumps(fn(path, int(threads), int(ctx), int(new))))
        return
    rows = []
    for threads in map(int, a.threads.split(",")):
        for ctx in map(int, a.contexts.split(",")):
            for f in a.files:
                got = {"kvscope": [], "llama.cpp": []}
                for _ in range(a.rounds):  # interleaved: kvscope, llama.cpp, kvscope, ...
                    got["kvscope"].append(run(sys.executable, "kvscope", f, threads, ctx, a.new))
                    if a.llama_python:
                        got["llama.cpp"].append(run(a.llama_python, "llama", f, threads, ctx, a.new))
                row = dict(file=Path(f).name, threads=threads, ctx=ctx, **{k: _median(v) for k, v in got.items()})
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


def _median(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0] if results else {}
    out = {k: round(statistics.median(r[k] for r in ok), 3) for k in ok[0] if isinstance(ok[0][k], (int, float))}
    out["each"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()
                    if k in ("ttft_s", "decode_tok_s", "peak_mb")} for r in ok]
    return {**out, **{k: v for k, v in ok[0].items() if isinstance(v, (str, list))}}


if __name__ == "__main__":
    main()
