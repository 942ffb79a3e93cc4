"""Decode against llama.cpp in paired turns: each side loads a file once in a process kept alive, then the two are
asked in turn for a reply of ``--new`` tokens after the same prompt, ``--pairs`` times (which side goes first
alternates); each pair's ratio ours / llama.cpp, and the median of the pairs.

Why pairs: on a shared host the memory bandwidth a decode runs at swings over minutes (here ``torch.sum`` over
600 MB read 23 to 46 GB/s within ten minutes), so two processes measured a minute apart (``measure_fit.py``, one
load a process) differ mostly by the host's minute; turns seconds apart see the same host. Not a test: a measure.

    python tests/engine/measure_decode_pairs.py --llamacpp PYTHON --gguf FILE [--gguf FILE ...]
        [--folder DIR --cases nf4,int8,bfloat16] [--threads 2] [--pairs 8] [--context 128] [--new 64] [--json OUT]

The folder's cases are paired with the GGUF of the nearest format (bfloat16 with the BF16 file, int8 with Q8_0, nf4
with Q4_K_M: the first ``--gguf`` named so). Our side: the engine as the app runs it (its compiled step built and its
trial over in a first, untimed reply); llama.cpp's: llama-cpp-python with ``flash_attn``, one untimed reply first.
A turn's rate counts the tokens after the first (the prompt's time apart). Only the standard library at the top:
llama.cpp's side runs this file under its own Python.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import measure_fit as mf  # noqa: E402 - the prompt, the model code's import and the bytecode, as measure_fit's

PAIRED = {"bfloat16": "bf16", "int8": "q8_0", "nf4": "q4_k_m"}  # a folder case -> the GGUF name part it meets
SETTLE_S = 0.5  # between turns: the idle side's worker threads stop spinning (OpenMP's, ggml's) before the next


# -- the children: a load, then a turn per line on stdin ---------------------------------------------------------
def engine_side(source: str, case: str, context: int, threads: int, new: int):
    """Our side: a function running one timed reply (tokens a second after the first)."""
    import torch

    torch.set_num_threads(threads)
    from engine.config import CacheConfig, ModelSpec, SamplingConfig
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession
    from engine.model.loader import load_model

    quant = case if case in ("int8", "nf4") else "none"
    lm = load_model(ModelSpec(source=source, device="cpu", quantization=quant,
                              dtype="bfloat16" if case == "bfloat16" else "auto"))
    mf._packed(lm.model)
    lm.fast.start()
    lm.fast.wait(900)
    session = ChatSession(lm, CacheConfig())

    def turn() -> dict:
        session.reset()
        session.start_ids(mf._prompt(context), SamplingConfig(max_new_tokens=new + 1, ignore_eos=True))
        stamps = [time.perf_counter() for r in drive(session) if r.event is not None]
        return dict(tps=(len(stamps) - 1) / (stamps[-1] - stamps[0]), fast=lm.fast.state)
    return turn


def llamacpp_side(source: str, context: int, threads: int, new: int):
    """llama.cpp's side: a function running one timed reply (tokens fed back as measure_fit's side feeds them)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=source, n_ctx=max(1024, context + new + 8), n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False, flash_attn=True)

    def turn() -> dict:
        llm.reset()
        llm.eval(mf._prompt(context))
        stamps, tok = [time.perf_counter()], 5
        for _ in range(new):
            llm.eval([tok])
            tok = (tok * 13 + 7) % 500 + 3
            stamps.append(time.perf_counter())
        return dict(tps=new / (stamps[-1] - stamps[0]))
    return turn


def child(kind: str, source: str, case: str, context: int, threads: int, new: int) -> None:
    turn = engine_side(source, case, context, threads, new) if kind == "engine" else \
        llamacpp_side(source, context, threads, new)
    turn()  # untimed: the compiled step's trial, the first touch of every page
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps(turn()), flush=True)


# -- the parent -----------------------------------------------------------------------------------------------
class Side:
    """A child process held alive: ``ask()`` runs one turn and returns its row."""

    def __init__(self, python: str, args: list[str], threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(HERE.parents[1]))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.p = subprocess.Popen([python, __file__, "--child", *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"a side ended (exit status {self.p.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def ready(self) -> None:
        self._read()

    def ask(self) -> dict:
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
            self.p.wait(60)


def pairs(ours: list[str], theirs: list[str], a) -> dict:
    """One match: both sides loaded (one at a time), then ``a.pairs`` pairs of turns."""
    rows, sides = [], []
    try:
        for python, args in ((sys.executable, ours), (a.llamacpp, theirs)):
            sides.append(Side(python, args, a.threads))
            sides[-1].ready()  # loaded one at a time: neither load nor trial shares the cores
        for i in range(a.pairs):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            got = {}
            for k in order:
                time.sleep(SETTLE_S)
                got[k] = sides[k].ask()
            rows.append((got[0]["tps"], got[1]["tps"]))
    finally:
        for s in sides:
            s.close()
    ratios = [o / t for o, t in rows]
    return dict(ours=ours[1] if ours[2] == "none" else ours[2], theirs=Path(theirs[1]).name, threads=a.threads,
                context=a.context, turns=rows, ratios=ratios, median=statistics.median(ratios),
                low=min(ratios), high=max(ratios))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", type=Path, action="append", default=[])
    ap.add_argument("--folder", type=Path)
    ap.add_argument("--cases", default="")
    ap.add_argument("--llamacpp", required=False, default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.child:
        kind, source, case, ctx, th, new = a.child
        child(kind, source, case, int(ctx), int(th), int(new))
        return 0
    if not a.llamacpp:
        ap.error("--llamacpp PYTHON (a Python with llama_cpp installed) is needed")
    for p in [*a.gguf, *([a.folder] if a.folder else []), Path(a.llamacpp)]:
        if not p.exists():
            ap.error(f"{p}: no such file or folder")
    if a.pairs < 1 or a.new < 2 or a.context < 1 or a.threads < 1:
        ap.error("--pairs, --context and --threads must be at least 1, --new at least 2")
    mf._compiled()
    common = [str(a.context), str(a.threads), str(a.new)]
    matches = [(["engine", str(g), "none", *common], ["llamacpp", str(g), "-", *common]) for g in a.gguf]
    for case in filter(None, a.cases.split(",")):
        g = next((g for g in a.gguf if PAIRED.get(case, "?") in g.name.lower()), None)
        if a.folder is None or g is None:
            ap.error(f"the folder case {case} needs --folder and a --gguf whose name has {PAIRED.get(case)}")
        matches.append((["engine", str(a.folder), case, *common], ["llamacpp", str(g), "-", *common]))
    out = []
    for ours, theirs in matches:
        try:
            r = pairs(ours, theirs, a)
        except RuntimeError as e:  # a side could not load its file or died: its own error is above, on stderr
            print(f"{Path(ours[1]).name}: {e}", file=sys.stderr)
            return 1
        out.append(r)
        print(f"{Path(r['ours']).name:>16} vs {r['theirs']:<16} {a.threads}t ctx {a.context}: "
              f"median x{r['median']:.2f} "
              f"(pairs x{r['low']:.2f}-x{r['high']:.2f}; ours {statistics.median(o for o, _ in r['turns']):.1f}, "
              f"llama.cpp {statistics.median(t for _, t in r['turns']):.1f} tok/s)", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
