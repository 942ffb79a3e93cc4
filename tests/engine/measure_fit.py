"""The fit verdict against measured memory, and a load's peak against llama.cpp's on the same weights.

    python tests/engine/measure_fit.py --folder DIR [--gguf FILE ...] [--llamacpp PYTHON] [--context 1024]
                                       [--cases none,bfloat16,int8,nf4] [--rounds 1] [--threads 1]
    python tests/engine/measure_fit.py --make DIR   # the Llama-3.2-1B shape, random bf16 weights, stories260K's
                                                    # 512-token vocabulary (hidden 2048, 16 layers, 32/8 heads)

Each load runs in a fresh process: the imports first, timed apart from the load (torch, the engine and transformers'
model code for the source's architecture; llama.cpp's side: ``import llama_cpp``, which loads its libraries), the
process's RSS once they are imported (idle), the fit verdict
(``engine.model.fit``, computed in that process before the load), then the load (its wall time; the RSS after it and
the peak while loading, VmHWM, read once a GGUF's repacking, on a thread after the load, is done), then (the
engine's compiled decode step started and waited for, as the app starts it after a load, timed apart) a prompt of
``--context`` tokens and 64 decoded tokens (time to first token, decode tokens/s, the RSS and the peak after). The verdict's numbers beside them:

    load peak    idle + fit.load_bytes
    after load   idle + libraries + weights as held
    running      idle + libraries + runtime + weights + activations(context) + KV(context) [+ a quantized cache's
                 buffer]

and the ratio measured / estimated (goal: within 10%). ``--gguf`` files (the same weights through llama.cpp's
converter / quantizer) are loaded by the engine too (its GGUF path) and, with ``--llamacpp`` (a Python with
``llama_cpp``), by llama.cpp: its idle RSS, peak, RSS after load, load time, TTFT and decode, rounds interleaved
with the engine's. Not a test: timings are never asserted; the machine is shared, say so beside the numbers.
Only the standard library is imported at the top: llama.cpp's side runs this file under its own Python.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DECODE = 64  # the compiled step's 3:1 trial (its first 8-32 steps) included, as a chat decodes it
TRIAL = 33  # the first token and the longest trial's 32 steps (``steady_tps``: the decode after them)
SHAPE_1B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, vocab=512)


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now, VmHWM: the peak so far)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key + ":")).split()[1]) * 1024


def _prompt(n: int) -> list[int]:
    return [1] + [(i * 7) % 500 + 3 for i in range(n - 1)]


# -- the children ---------------------------------------------------------------------------------------------
def _model_code(source: str) -> None:
    """Import transformers' model code for the source's architecture (what a first load in a process imports: ~1.5 s
    here, the import of the library that runs it, as ``import llama_cpp`` is llama.cpp's)."""
    import importlib

    if source.lower().endswith(".gguf"):
        from engine.model.gguf_file import read_gguf

        kind = read_gguf(source).architecture
    else:
        kind = json.loads((Path(source) / "config.json").read_text())["model_type"]
    importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    try:
        importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    except ImportError:
        importlib.import_module("transformers.modeling_utils")


def _packed(model, timeout: float = 600.0) -> None:
    """Wait for the repacking a GGUF load leaves to a thread, and the mapping of the pages of the weights multiplied
    in place after it (``engine.quant.modules.pack_soon``: a BF16 file's or folder's whole weights)."""
    import threading

    from engine.quant.modules import BlockLinear

    end = time.perf_counter() + timeout
    while any(isinstance(m, BlockLinear) and m.pending() for m in model.modules()) and time.perf_counter() < end:
        time.sleep(0.02)
    for t in threading.enumerate():
        if t.name == "kvscope-gguf-pack":
            t.join(max(0.0, end - time.perf_counter()))


def child_engine(source: str, case: str, context: int, threads: int) -> dict:
    t0 = time.perf_counter()
    if case.endswith("-fresh"):  # int8-fresh / nf4-fresh: quantized at load, no copy kept or mapped
        case = case.removesuffix("-fresh")
        os.environ["KVSCOPE_QUANTIZED_CACHE"] = "off"
    import torch

    torch.set_num_threads(threads)
    from engine.config import CacheConfig, ModelSpec, SamplingConfig
    from engine.model import fit
    from engine.model.loader import load_model

    idle = _status("VmRSS")  # torch and the engine imported (transformers' model code counts above it, as before)
    _model_code(source)
    import_s = time.perf_counter() - t0  # torch and the engine's loader imported: the idle engine the verdict adds to
    quant = case if case in ("int8", "nf4") else "none"
    spec = ModelSpec(source=source, device="cpu", quantization=quant, dtype="bfloat16" if case == "bfloat16" else "auto")
    f = fit.estimate_path(Path(source), spec, "cpu")
    t = time.perf_counter()
    lm = load_model(spec)
    load_s = time.perf_counter() - t
    _packed(lm.model)  # a GGUF's repacking runs on a thread after the load: its memory is the load's
    after, load_peak = _status("VmRSS"), _status("VmHWM")
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession

    t = time.perf_counter()
    lm.fast.start()  # as the app and the server do after a load: the compiled decode step, built once per shape by
    lm.fast.wait(900)  # a child and loaded from its cache after that; timed apart (a user typing the first prompt)
    fast_s, fast = time.perf_counter() - t, f"{lm.fast.state} {lm.fast.reason}".strip()
    session = ChatSession(lm, CacheConfig())
    t = time.perf_counter()
    session.start_ids(_prompt(context), SamplingConfig(max_new_tokens=DECODE + 1, ignore_eos=True))
    stamps = [time.perf_counter() for r in drive(session) if r.event is not None]
    ttft = stamps[0] - t if stamps else 0.0
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    late = stamps[TRIAL:]  # after the compiled step's trial (its eager steps slow the mean at two threads)
    steady = (len(late) - 1) / (late[-1] - late[0]) if len(late) > 1 else 0.0
    label = Path(source).name if source.lower().endswith(".gguf") else case
    label += "-fresh" if os.environ.get("KVSCOPE_QUANTIZED_CACHE") == "off" and case in ("int8", "nf4") else ""
    return dict(side="kvscope", case=label, idle=idle, import_s=import_s, load_s=load_s, fast_s=fast_s, fast=fast, after=after, load_peak=load_peak,
                running=_status("VmRSS"), peak=_status("VmHWM"), ttft_s=ttft, decode_tps=decode, steady_tps=steady,
                weights=lm.info.weights_bytes, format=f"{lm.info.weights_format} {lm.info.weights_held}",
                est_load_peak=idle + f.load_bytes, est_after=idle + f.libraries + f.tokenizer + f.weights.bytes,
                est_running=idle + f.total_at(context + DECODE),
                est_weights=f.weights.bytes)


def child_llamacpp(path: str, context: int, threads: int) -> dict:
    t0 = time.perf_counter()
    import llama_cpp
    import llama_cpp.llama as ll

    import_s = time.perf_counter() - t0

    if os.environ.get("LC_NO_EXTRA_BUFTS"):  # AMX / repack buffers off where they fault (the bench README)
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p
        ll.llama_cpp.llama_model_default_params = params
    idle = _status("VmRSS")
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=max(1024, context + DECODE + 8), n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False, flash_attn=True)
    load_s = time.perf_counter() - t
    after, load_peak = _status("VmRSS"), _status("VmHWM")
    t = time.perf_counter()
    llm.eval(_prompt(context))
    ttft = time.perf_counter() - t
    stamps, tok = [time.perf_counter()], 5
    for _ in range(DECODE):
        llm.eval([tok])
        tok = (tok * 13 + 7) % 500 + 3
        stamps.append(time.perf_counter())
    decode = DECODE / (stamps[-1] - stamps[0])
    late = stamps[TRIAL:]  # the same tokens as the engine's steady decode
    steady = (len(late) - 1) / (late[-1] - late[0])
    return dict(side="llama.cpp", case=Path(path).name, idle=idle, import_s=import_s, load_s=load_s, after=after, load_peak=load_peak,
                running=_status("VmRSS"), peak=_status("VmHWM"), ttft_s=ttft, decode_tps=decode, steady_tps=steady)


def _compiled() -> None:
    """The engine's modules compiled to bytecode once, as an installed app's are: where PYTHONDONTWRITEBYTECODE is
    set (this project's machine sets it), every child compiled them again, ~0.03 s of a first GGUF load's
    imports that a user's load never pays (llama-cpp-python's side is installed, compiled)."""
    import compileall

    compileall.compile_dir(str(ROOT / "engine"), quiet=1)


def drop_pages(source: str) -> None:
    """Ask the kernel to let go of the cached pages of ``source`` (a file, or a folder's files): the next load reads
    them from the disk, whichever side loads first. Without it the first side of a round pays the cold read and the
    second finds the file in memory. Pages of a file still mapped by a live process stay (none here: each load is a
    child that has exited). A folder's quantized copy (``--quantize``'s, kept in the data folder) is not dropped: its
    cases are measured warm either way."""
    root = Path(source)
    for f in ([root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run_child(python: str, args: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the compiled modules read, as on a user's machine (``_compiled``)
    p = subprocess.run([python, __file__, "--child", *args], capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["exit status " + str(p.returncode)])[-1], "args": args}
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- the 1B folder --------------------------------------------------------------------------------------------
def make_folder(out: Path) -> None:
    """The Llama-3.2-1B shape with seeded random bf16 weights (std 0.02), stories260K's tokenizer; written tensor by
    tensor into one safetensors file (1.95 GB)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    s = SHAPE_1B
    out.mkdir(parents=True, exist_ok=True)
    head = s["hidden"] // s["heads"]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
           "intermediate_size": s["inter"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv_heads"], "head_dim": head, "vocab_size": s["vocab"],
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
           "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "bfloat16", "dtype": "bfloat16",
           "attention_bias": False, "mlp_bias": False}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    h, kvw = s["hidden"], s["kv_heads"] * head
    sd = {"model.embed_tokens.weight": r(s["vocab"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.k_proj.weight": r(kvw, h),
                   p + "self_attn.v_proj.weight": r(kvw, h), p + "self_attn.o_proj.weight": r(h, h),
                   p + "mlp.gate_proj.weight": r(s["inter"], h), p + "mlp.up_proj.weight": r(s["inter"], h),
                   p + "mlp.down_proj.weight": r(h, s["inter"]),
                   p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    stories = ROOT / "resources" / "models" / "stories260K"
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(stories / name, out)


# -- the table ------------------------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def report(rows: list[dict]) -> None:
    print("\nside       case              idle  load peak (est, ratio)   after load (est, ratio)  running (est, ratio)"
          "     peak  import s  load s  TTFT s  decode tok/s (after the trial)  weights as held")
    for r in rows:
        if "error" in r:
            print(f"error: {r['args']}: {r['error']}")
            continue
        est = ""
        if r["side"] == "kvscope":
            est = [f"{_mib(r[k])} ({_mib(r['est_' + k])}, {r[k] / r['est_' + k]:.3f})"
                   for k in ("load_peak", "after", "running")]
        else:
            est = [_mib(r[k]) for k in ("load_peak", "after", "running")]
        print(f"{r['side']:10} {r['case']:16} {_mib(r['idle']):>5}  {est[0]:24} {est[1]:24} {est[2]:24} "
              f"{_mib(r['peak']):>6}  {r.get('import_s', 0):8.2f}  {r['load_s']:6.2f}  {r['ttft_s']:6.2f}  {r['decode_tps']:8.2f} ({r.get('steady_tps', 0):6.2f})  "
              f"{r.get('format', '')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--make", type=Path, help="write the 1B-shape bf16 folder here and exit")
    ap.add_argument("--folder", type=Path, help="a bf16 Hugging Face folder (see --make)")
    ap.add_argument("--gguf", type=Path, action="append", default=[], help="a GGUF file of the same weights")
    ap.add_argument("--llamacpp", default="", help="a Python with llama_cpp installed (llama.cpp's side)")
    ap.add_argument("--cases", default="none,bfloat16,int8,nf4", help="the folder's loads: none (float32 on a CPU), "
                    "bfloat16, int8, nf4 (mapped from the quantized copy once a first load kept one), "
                    "int8-fresh, nf4-fresh (quantized at load: copies off)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="drop the source's pages from the page cache before each "
                    "load (both sides read it from the disk)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    if a.child:
        kind, source, case, ctx, th = a.child
        out = child_engine(source, case, int(ctx), int(th)) if kind == "engine" else \
            child_llamacpp(source, int(ctx), int(th))
        print(json.dumps(out))
        return 0
    if a.make:
        make_folder(a.make)
        return 0
    jobs = [("engine", str(a.folder), c) for c in a.cases.split(",") if a.folder and c]
    for g in a.gguf:
        jobs.append(("engine", str(g), "none"))
        if a.llamacpp:
            jobs.append(("llamacpp", str(g), "-"))
    _compiled()
    rows = []
    for rnd in range(a.rounds):
        for kind, source, case in (jobs if rnd % 2 == 0 else jobs[::-1]):  # sides interleaved, order alternated
            python = a.llamacpp if kind == "llamacpp" else sys.executable
            if a.cold:
                drop_pages(source)
            row = _run_child(python, [kind, source, case, str(a.context), str(a.threads)], a.threads)
            rows.append(row)
            print(json.dumps(row), flush=True)
    report(rows)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
