"""Load time and peak memory of one model as a safetensors folder, a GGUF F32 file and a GGUF Q8_0 file (#32).

    python tests/engine/measure_gguf_load.py [--shape smollm2-135m] [--rounds 3] [--dir DIR]

Writes the three forms of a seeded random-weight model of the shape (``engine.model.shapes``; stories260K's
vocabulary as its tokenizer), then loads each with ``engine.model.loader.load_model`` in a fresh process, rounds
interleaved (the machine is shared), and prints each load's wall time and the process's peak RSS (``ru_maxrss``)
less the RSS of the same process before loading (torch and transformers imported), as medians and ratios against
the folder. Not a test: timings are never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHILD = r"""
import json, sys, time
import torch, transformers  # imported before the baseline: only the load is measured
from engine.model.loader import load_model
def hwm():  # the process's peak resident memory so far, KiB
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
base = hwm()
t = time.perf_counter()
lm = load_model(sys.argv[1])
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "peak_mib": (hwm() - base) / 1024, "weights_mib": lm.info.weights_bytes / 2**20}))
"""


def write_forms(shape: str, d: Path) -> dict[str, Path]:
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(HERE))
    from gguf_make import write_gguf

    from engine.model.shapes import SHAPES

    kw = dict(SHAPES[shape])
    arch = kw.pop("arch")
    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    stories = ROOT / "resources" / "models" / "stories260K"
    folder = d / f"{shape}-folder"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(stories / name, folder / name)
    forms = {"safetensors": folder}
    for q in ("F32", "Q8_0"):
        forms[f"gguf-{q}"] = write_gguf(model, arch, stories / "tokenizer.model", d / f"{shape}-{q}.gguf", q)
    return forms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path)
    a = p.parse_args()
    d = a.dir or Path(tempfile.mkdtemp(prefix="gguf-load-"))
    forms = write_forms(a.shape, d)
    rows: dict[str, list[dict]] = {k: [] for k in forms}
    for _ in range(a.rounds):
        for name, path in forms.items():
            out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, cwd=ROOT,
                                 check=True)
            rows[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    ref_s = statistics.median(r["s"] for r in rows["safetensors"])
    ref_m = statistics.median(r["peak_mib"] for r in rows["safetensors"])
    for name, rs in rows.items():
        s = statistics.median(r["s"] for r in rs)
        m = statistics.median(r["peak_mib"] for r in rs)
        size = sum(f.stat().st_size for f in forms[name].glob("*")) if forms[name].is_dir() else forms[name].stat().st_size
        print(f"{name:12} file {size / 2**20:7.1f} MiB  load {s:6.2f} s (x{s / ref_s:.2f})  peak +{m:7.1f} MiB "
              f"(x{m / ref_m:.2f})  weights {rs[0]['weights_mib']:.1f} MiB  runs {[round(r['s'], 2) for r in rs]}")


if __name__ == "__main__":
    main()
