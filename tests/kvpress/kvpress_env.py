"""NVIDIA's kvpress 0.5.5 in a venv of its own, made once and cached, for the side-by-side with our eviction
policies (``tests/kvpress/test_kvpress_side_by_side.py``, ``python -m tests.kvpress.measure``).

kvpress 0.5.5 pins transformers < 5.3 (we pin 5.24), so it cannot share our venv: it gets
``KVSCOPE_KVPRESS_VENV`` (default ~/.cache/kvscope-bench/kvpress), with the same torch 2.13 CPU build and
transformers 5.2 (~1 min from the package index, once). ``kvpress_run.py`` runs inside it on the same weights
and token ids as our side, and answers in JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KVPRESS = "kvpress==0.5.5"
TRANSFORMERS = "transformers==5.2.0"  # the newest kvpress 0.5.5 accepts (< 5.3)
TORCH = "torch==2.13.0"
RUNNER = Path(__file__).resolve().with_name("kvpress_run.py")

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tests/: the shared cached_venv
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cached_venv import cached_venv  # noqa: E402



class VenvUnavailable(RuntimeError):
    """The venv could not be made (no package index, a wheel missing): the side-by-side is skipped with this."""


def venv_dir() -> Path:
    return Path(os.environ.get("KVSCOPE_KVPRESS_VENV", Path.home() / ".cache" / "kvscope-bench" / "kvpress"))


def ensure_venv(log=lambda msg: None) -> Path:
    """The venv's python, made (and checked importable) on first use; ``VenvUnavailable`` with pip's last line
    when it cannot be made (offline, say)."""
    return cached_venv(venv_dir(), [["-m", "pip", "install", "-q", TORCH],
                                    ["-m", "pip", "install", "-q", KVPRESS, TRANSFORMERS],
                                    ["-c", "import kvpress, transformers; print(transformers.__version__)"]],
                       f"{KVPRESS} {TRANSFORMERS}", log, error=VenvUnavailable)


def run(py: Path, job: dict, timeout: float = 900) -> dict:
    """Run ``kvpress_run.py`` in the venv on ``job``; its JSON answer."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TRANSFORMERS_VERBOSITY="error")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(py), str(RUNNER)], input=json.dumps(job), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, env=env)
    if done.returncode:
        raise RuntimeError(f"kvpress run failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout)


if __name__ == "__main__":
    print(ensure_venv(lambda m: print(f"[kvpress] {m}", flush=True)))
