"""Every hostile model file of ``hostile_models`` through ``python -m engine generate``, each in a fresh process:
its exit status, seconds, peak RSS (VmHWM, polled) against a clean load of the same model, and its one line.

    python tests/engine/measure_hostile_models.py [--timeout 60] [--only NAME,...]

Goal: every case exit 2 with one line naming the file and the value, under 500 MB above a clean load and 10 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import hostile_models  # noqa: E402


def _hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(args: list[str], timeout: float) -> tuple[int, float, float, str]:
    """(exit status, seconds, peak MiB, stderr) of ``python -m engine`` with ``args``; killed past ``timeout``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _hwm_kib(proc.pid))
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            break
        time.sleep(0.05)
    _, err = proc.communicate()
    return proc.returncode, time.perf_counter() - t0, peak / 1024, err.strip()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--only", default="")
    a = p.parse_args()
    d = Path(tempfile.mkdtemp(prefix="kvscope-hostile-"))
    cases = hostile_models.make(d, ROOT / "resources/models/stories260K")
    chat = hostile_models.messages_file(d)
    only = set(filter(None, a.only.split(",")))

    def argv(path: Path, as_chat: bool) -> list[str]:
        how = ["--messages", str(chat)] if as_chat else ["--prompt", "hi"]
        return ["generate", "--model", str(path), *how, "--max-new-tokens", "2"]

    rc, s, clean, _ = run(argv(d / "base.gguf", True), a.timeout)
    print(f"clean load of base.gguf (a chat): exit {rc}, {s:.1f} s, peak {clean:.0f} MiB")
    print("| case | exit | s | peak MiB (above clean) | clean | line |\n|---|---|---|---|---|---|")
    n_clean = worst_s = worst_mb = 0
    for name, case in cases.items():
        if only and name not in only:
            continue
        rc, s, mb, err = run(argv(case.path, case.chat), a.timeout)
        lines = err.splitlines()
        ok = rc == 2 and len(lines) == 1 and case.expect in err and "internal" not in err and s < 10 \
            and mb - clean < 500
        n_clean += ok
        worst_s, worst_mb = max(worst_s, s), max(worst_mb, mb - clean)
        print(f"| {name} | {rc} | {s:.1f} | {mb:.0f} ({mb - clean:+.0f}) | {'yes' if ok else 'NO'} | "
              f"{(lines[-1] if lines else '')[:220]} |", flush=True)
    total = len([n for n in cases if not only or n in only])
    print(f"clean {n_clean} / {total}; worst {worst_s:.1f} s, {worst_mb:+.0f} MiB above a clean load")


if __name__ == "__main__":
    main()
