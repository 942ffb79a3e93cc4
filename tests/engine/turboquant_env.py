"""The ``turboquant`` package (0.2.0, a TurboQuant implementation for HF models) beside ours, on the same model and
text: its own venv, made once and cached, and both sides' rows.

The venv (``KVSCOPE_TURBOQUANT_VENV``, default ~/.cache/kvscope/turboquant-0.2.0) gets scipy and the package from
the package index; torch and transformers are the project's own, through a ``.pth`` to this venv's site-packages, so
both sides run the same versions (the package asks for torch>=2.2, transformers>=4.40). ``reference_rows`` runs
``turboquant_ref.py`` there; ``our_rows`` scores our tq kinds with ``python -m engine quality``'s code.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "turboquant==0.2.0"
ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT / "resources" / "models" / "stories260K"
REF = Path(__file__).with_name("turboquant_ref.py")
TOKENS = 511  # stories260K's context less one: the quality command's default text, cut as it cuts it

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tests/: the shared cached_venv
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cached_venv import cached_venv  # noqa: E402



def venv_dir() -> Path:
    return Path(os.environ.get("KVSCOPE_TURBOQUANT_VENV", Path.home() / ".cache" / "kvscope" / "turboquant-0.2.0"))


def ensure_venv(log=print) -> Path:
    """The venv's python, made (and checked importable) on first use; raises ``RuntimeError`` with pip's last line
    when it cannot be made (offline, no index). It sees our site-packages (torch, transformers) through a .pth."""
    def see_ours(venv: Path) -> None:
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        (venv / "lib" / ver / "site-packages" / "kvscope-project.pth").write_text(site.getsitepackages()[0] + "\n")

    return cached_venv(venv_dir(), [["-m", "pip", "install", "-q", "scipy", PACKAGE, "--no-deps"],
                                    ["-c", "import turboquant, scipy, torch, transformers"]], PACKAGE, log, see_ours)


def token_ids() -> list[int]:
    from transformers import AutoTokenizer

    from engine.tools.quality import DEFAULT_TEXT

    return [int(t) for t in AutoTokenizer.from_pretrained(STORIES)(DEFAULT_TEXT)["input_ids"]][:TOKENS]


def reference_rows(py: Path, ids: list[int], bits=(4, 3, 2), residuals=(-16, 16, 128)) -> list[dict]:
    """The package's rows (one process each: its quantizers are module-level state); a residual of -16: our page
    policy (the page of 16 being filled exact) around its quantizer."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "ids.json"
        tokens.write_text(json.dumps(ids))
        for b in bits:
            for r in residuals:
                out = Path(tmp) / f"{b}-{r}.json"
                run = subprocess.run([str(py), str(REF), str(STORIES), str(tokens), str(b), str(r), str(out)],
                                     capture_output=True, text=True)
                if run.returncode:
                    raise RuntimeError((run.stderr.strip().splitlines() or ["failed"])[-1])
                rows.append(json.loads(out.read_text()))
    return rows


def our_rows(lm, ids: list[int], kinds=("tq4", "tq3", "tq2")) -> list[dict]:
    """Ours on the same ids, K and V at the same bits (``python -m engine quality``'s scoring)."""
    from engine.tools import quality

    return quality.score(lm, ids, [quality.Setting(k, k) for k in kinds], greedy_tokens=1)["rows"]
