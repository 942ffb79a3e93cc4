"""A venv of its own for a reference tool whose pins clash with ours (vLLM, kvpress, turboquant): made once,
checked importable, marked ready, and reused until its folder goes (each user's cache folder; CI starts without)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

READY = ".kvscope-ready"


def cached_venv(venv: Path, steps: list[list[str]], stamp: str, log: Callable[[str], None] = lambda _m: None,
                made: Callable[[Path], None] | None = None, error: type[Exception] = RuntimeError) -> Path:
    """The python of ``venv``. When it is not ready: a fresh venv (``made(venv)`` then, e.g. to see our
    site-packages), each of ``steps`` run with its python (``["-m", "pip", "install", "-q", ...]``, the last one
    an import check), then ``stamp`` written as the ready mark. A failed step removes the venv and raises
    ``error`` with its command and the last line it printed."""
    py = venv / "bin" / "python"
    ok = venv / READY
    if ok.exists() and py.exists():
        return py
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    for cmd in [[sys.executable, "-m", "venv", str(venv)], *([str(py), *step] for step in steps)]:
        log(" ".join(cmd[-3:]))
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            shutil.rmtree(venv, ignore_errors=True)
            last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
            raise error(f"cannot make the venv {venv.name} ({' '.join(cmd[-2:])}): {last}")
        if cmd[0] == sys.executable and made is not None:
            made(venv)
    ok.write_text(stamp)
    return py
