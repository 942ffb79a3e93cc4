"""Decode and time to first token against llama.cpp on the same weights, interleaved (not a test: a measure
script whose results engine/README.md reports).

    python tests/engine/measure_llamacpp.py --lc-python LC_VENV/bin/python --hf SMOL_FOLDER \\
        --gguf float32=smol-f32.gguf --gguf bfloat16=smol-bf16.gguf \\
        --kvscope after=. --kvscope before=/tmp/base --rounds 3 --json h2h.json

``LC_VENV`` has ``llama-cpp-python`` (built with ``CMAKE_ARGS=-DGGML_NATIVE=ON``); the GGUF files are the HF folder
converted by llama.cpp's own ``convert_hf_to_gguf.py``. Each ``--kvscope NAME=CHECKOUT`` runs that checkout's
``python -m engine bench --modes paged`` (its compiled step, built before the timed tokens); each round runs every
side at every dtype once, one process at a time, so a shared machine's drifting load hits all alike. One thread
each (``--threads N``: N on both sides). Medians over rounds; ratios of every kvscope side to llama.cpp in the same
run.

This file also runs itself under ``LC_VENV``'s python as the llama.cpp side (``--peer``): token ids fed directly
(no tokenizer), a CTX-token prompt evaluated at once, then single-token evals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONTEXTS = (128, 512)


def peer(gguf: str, threads: int, new_tokens: int, contexts: list[int]) -> dict:
    """The llama.cpp side, in the llama-cpp-python venv: per context, TTFT (prompt eval) and decode tok/s."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, flash_attn=True)
    out = {}
    for ctx in contexts:
        llm.reset()
        prompt = [1] + [(i * 7) % 500 + 3 for i in range(ctx - 1)]
        t = time.perf_counter()
        llm.eval(prompt)
        ttft = time.perf_counter() - t
        tok, spent = 5, 0.0
        for _ in range(new_tokens):
            t = time.perf_counter()
            llm.eval([tok])
            spent += time.perf_counter() - t
            tok = (tok * 13 + 7) % 500 + 3
        out[str(ctx)] = {"ttft_ms": ttft * 1000, "decode_tokens_per_s": new_tokens / spent}
    return out


def run_peer(a, gguf: str) -> dict:
    cmd = [a.lc_python, os.path.abspath(__file__), "--peer", gguf, "--new-tokens", str(a.new_tokens),
           "--threads", str(a.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode:
        raise RuntimeError(f"llama.cpp side failed: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_kvscope(a, checkout: str, dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "engine", "bench", "--model", a.hf, "--contexts", ",".join(map(str, CONTEXTS)),
               "--new-tokens", str(a.new_tokens), "--modes", "paged", "--dtype", dtype, "--json", out]
        env = dict(os.environ, KVSCOPE_THREADS=str(a.threads), PYTHONPATH=checkout)
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=checkout, env=env, timeout=7200)
        if p.returncode:
            raise RuntimeError(f"kvscope ({checkout}) failed: {p.stderr.strip().splitlines()[-1:]}")
        with open(out, encoding="utf-8") as f:
            res = json.load(f)
    rows = {str(r["context"]): {"ttft_ms": r["ttft_ms"], "decode_tokens_per_s": r["decode_tokens_per_s"]}
            for r in res["rows"] if r.get("engine") == "kvscope"}
    rows["step"] = res.get("step", {}).get("state")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--lc-python")
    p.add_argument("--hf", help="the HF folder the GGUF files were converted from")
    p.add_argument("--gguf", action="append", default=[], metavar="DTYPE=FILE")
    p.add_argument("--kvscope", action="append", default=[], metavar="NAME=CHECKOUT")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads for both sides (the issue's measure: 1)")
    p.add_argument("--json", dest="json_file")
    a = p.parse_args()
    if a.peer:
        print(json.dumps(peer(a.peer, a.threads, a.new_tokens, list(CONTEXTS))))
        return 0
    ggufs = dict(g.split("=", 1) for g in a.gguf)
    sides = dict(k.split("=", 1) for k in a.kvscope)
    raw: dict[str, list] = {}
    for r in range(a.rounds):
        for dtype, gguf in ggufs.items():
            for name, fn in [("llama.cpp", lambda: run_peer(a, gguf))] + [
                    (n, (lambda c: lambda: run_kvscope(a, c, dtype))(c)) for n, c in sides.items()]:
                res = fn()
                raw.setdefault(f"{name} {dtype}", []).append(res)
                print(f"round {r + 1} {name} {dtype}: {json.dumps(res)}", file=sys.stderr, flush=True)
    summary = summarize(raw, ggufs, sides)
    print(table(summary))
    if a.json_file:
        with open(a.json_file, "w", encoding="utf-8") as f:
            json.dump({"raw": raw, "summary": summary}, f, indent=1)
    return 0


def summarize(raw: dict, ggufs: dict, sides: dict) -> dict:
    med = {}
    for key, runs in raw.items():
        for ctx in map(str, CONTEXTS):
            for fig in ("ttft_ms", "decode_tokens_per_s"):
                med[(key, ctx, fig)] = statistics.median(run[ctx][fig] for run in runs)
    rows = []
    for dtype in ggufs:
        for ctx in map(str, CONTEXTS):
            lc = {f: med[(f"llama.cpp {dtype}", ctx, f)] for f in ("ttft_ms", "decode_tokens_per_s")}
            row = {"dtype": dtype, "context": int(ctx), "llama.cpp": lc}
            for name in sides:
                ks = {f: med[(f"{name} {dtype}", ctx, f)] for f in ("ttft_ms", "decode_tokens_per_s")}
                ks["decode_ratio"] = ks["decode_tokens_per_s"] / lc["decode_tokens_per_s"]
                ks["ttft_ratio"] = lc["ttft_ms"] / ks["ttft_ms"]  # > 1: kvscope's first token comes sooner
                row[name] = ks
            rows.append(row)
    return {"rows": rows, "sides": list(sides)}


def table(s: dict) -> str:
    names = s["sides"]
    head = ("| weights, context | llama.cpp decode tok/s | " + " | ".join(f"{n} decode tok/s (÷ llama.cpp)" for n in names)
            + " | TTFT ms llama.cpp | " + " | ".join(f"{n} TTFT ms (speed ÷ llama.cpp)" for n in names) + " |")
    out = [head, "|" + "---|" * (3 + 2 * len(names))]
    for r in s["rows"]:
        lc = r["llama.cpp"]
        dec = [f"{r[n]['decode_tokens_per_s']:.1f} (×{r[n]['decode_ratio']:.2f})" for n in names]
        ttft = [f"{r[n]['ttft_ms']:,.0f} (×{r[n]['ttft_ratio']:.2f})" for n in names]
        out.append(f"| {r['dtype']}, {r['context']} | {lc['decode_tokens_per_s']:.1f} | " + " | ".join(dec)
                   + f" | {lc['ttft_ms']:,.0f} | " + " | ".join(ttft) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
