"""The closing note's measure for ``engine attach`` against hostile servers: runs the hostile tests with each
attach process recorded (``hostile_remote._record``) and prints one row per run — exit code, the line a user
sees, peak RSS (wait4) and wall time — then the summary: cases, clean exits, worst memory and time.

A clean exit: a hostile answer ends in exactly one ``error:`` line and exit 2; a hostile event stream ends in
exit 0 with the skipped events counted (the tests assert the counts).
Run: ``python tests/engine/measure_attach_hostile.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/engine/test_attach_hostile.py", "tests/engine/test_attach_hostile_events.py"]


def main() -> int:
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        path = f.name
    env = {**os.environ, "KVSCOPE_ATTACH_MEASURE": path}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES], cwd=ROOT,
                           env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    os.unlink(path)
    print("| case | exit | stderr | peak RSS MB | s |\n|---|---|---|---|---|")
    clean = 0
    for r in rows:
        ok = (r["rc"] == 2 and r["stderr_lines"] == 1 and r["line"].startswith("error: ")
              and "internal" not in r["line"]) or (r["rc"] == 0 and r["stderr_lines"] == 0)
        clean += ok
        name = r["case"].split("::", 1)[-1]
        print(f"| {name} | {r['rc']} | {r['line'][:110]} | {r['peak_mb']:.0f} | {r['seconds']:.1f} |")
    worst_mb = max(rows, key=lambda r: r["peak_mb"])
    worst_s = max(rows, key=lambda r: r["seconds"])
    print(f"\n{len(rows)} attach runs, {clean} clean; worst memory {worst_mb['peak_mb']:.0f} MB "
          f"({worst_mb['case'].split('::', 1)[-1]}), worst time {worst_s['seconds']:.1f} s "
          f"({worst_s['case'].split('::', 1)[-1]}); pytest: {tests.stdout.strip().splitlines()[-1]}")
    return 0 if clean == len(rows) and tests.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
