"""A venv of its own for a reference tool whose pins clash with ours (vLLM, kvpress, turboquant): made once,
checked importable, marked ready, and reused until its folder goes (each user's cache folder; CI starts without).

Making one is minutes of pip (vLLM's: ~5 min on CI's 2 cores), so a session that will need it can ``begin`` it in
the background when the tests are collected (a test module's ``early_start``, called by tests/conftest.py): it
installs beside the first tests, and ``cached_venv`` waits for that same making instead of starting another."""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

READY = ".kvscope-ready"
_making: dict[Path, concurrent.futures.Future] = {}  # a venv's folder -> its making in this process (one at a time)
_lock = threading.Lock()


def cached_venv(venv: Path, steps: list[list[str]], stamp: str, log: Callable[[str], None] = lambda _m: None,
                made: Callable[[Path], None] | None = None, error: type[Exception] = RuntimeError) -> Path:
    """The python of ``venv``. When it is not ready: a fresh venv (``made(venv)`` then, e.g. to see our
    site-packages), each of ``steps`` run with its python (``["-m", "pip", "install", "-q", ...]``, the last one
    an import check), then ``stamp`` written as the ready mark. A failed step removes the venv and raises
    ``error`` with its command and the last line it printed. A making begun in the background (``begin``) is
    waited for, its error raised here."""
    with _lock:
        fut = _making.get(venv)
    if fut is not None:
        return fut.result()
    return _make(venv, steps, stamp, log, made, error)


def begin(venv: Path, steps: list[list[str]], stamp: str, log: Callable[[str], None] = lambda _m: None,
          made: Callable[[Path], None] | None = None, error: type[Exception] = RuntimeError) -> None:
    """Make ``venv`` as ``cached_venv`` would, on a thread of its own, unless it is ready or being made; a later
    ``cached_venv`` of it waits for this making (and raises its error)."""
    if (venv / READY).exists() and (venv / "bin" / "python").exists():
        return
    with _lock:
        if venv in _making:
            return
        fut = _making[venv] = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(_make(venv, steps, stamp, log, made, error))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            fut.set_exception(e)

    threading.Thread(target=run, name=f"venv-{venv.name}", daemon=True).start()


def _make(venv: Path, steps: list[list[str]], stamp: str, log: Callable[[str], None],
          made: Callable[[Path], None] | None, error: type[Exception]) -> Path:
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
