"""Build the architecture coverage report: every zoo type, its cache layout, and what our engine does with it.

    python tests/engine/arch_report.py            # all types -> arch_report.{json,md}
    python tests/engine/arch_report.py gemma2 lfm2   # some types, printed only
    python tests/engine/arch_report.py --render      # the markdown again from the JSON
    python tests/engine/arch_report.py --save DIR mamba   # a folder for python -m engine

Each type runs in its own forked process (memory-capped, so one bad config cannot take the run down), two at
a time (about 4-8 minutes on 2 cores). Per type: ``probe`` (HF's own ``DynamicCache`` layout), every check of
``arch_run`` (all modes, two turns, two chats; 64 new tokens) and, for exact types, the engine's KV bytes
against HF's. Writes ``arch_report.json``, ``arch_report.md`` (from the JSON only) and ``arch_expect.py``.
"""

from __future__ import annotations

import json
import textwrap
import multiprocessing as mp
import resource
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

NEW_TOKENS = 64
MEMORY_CAP = 6 << 30


def one(model_type: str) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    import arch_run
    import arch_zoo

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    row: dict = {"model_type": model_type}
    t0 = time.perf_counter()
    try:
        model, _ = arch_zoo.tiny_model(model_type)
        row["build_s"] = round(time.perf_counter() - t0, 3)
        row["probe"] = arch_zoo.probe(model)
        row["summary"] = arch_zoo.summary(row["probe"])
    except Exception as e:  # noqa: BLE001
        row["build"] = arch_run.describe_error(e)
        return row
    t1 = time.perf_counter()
    row["run"] = arch_run.run_modes(model, model_type, NEW_TOKENS)
    row["run_s"] = round(time.perf_counter() - t1, 3)
    row["verdict"] = arch_run.verdict(row["run"])
    row["failure"] = arch_run.failure(row["run"]) if row["verdict"] == "failing" else ""
    if row["verdict"] == "exact":
        lm, _ = arch_run.load(model, model_type)
        row["bytes"] = arch_run.bytes_row(model, lm.info)
    return row


def collect(types: list[str], verbose: bool = False) -> list[dict]:
    """Rows in the order of ``types``, two processes at a time, forked after torch, transformers and the engine
    are imported (each child would otherwise spend seconds importing them)."""
    import torch

    import arch_run  # noqa: F401 - imported for the children

    torch.set_num_threads(1)
    rows = []
    with mp.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        for row in pool.imap(one, types):
            run = row.get("run", {})
            why = row.get("failure") or run.get("load", {}).get("reason") or row.get("build", "")
            print(f"{row['model_type']:28s} {row.get('verdict', 'build-error'):9s} {why}", flush=True)
            if verbose:
                print("   ", run.get("info"), row.get("bytes"))
                for mode, r in run.get("modes", {}).items():
                    print("   ", mode, r)
            rows.append(row)
    return rows


def main(argv: list[str]) -> None:
    import arch_zoo
    from arch_table import render

    if argv[:1] == ["--save"]:  # repro folders: python -m engine generate --model DIR/TYPE ...
        for t in argv[2:]:
            arch_zoo.save_folder(t, Path(argv[1]) / t, HERE.parents[2] / "resources" / "models" / "stories260K")
            print(Path(argv[1]) / t)
        return
    if argv == ["--render"]:  # markdown and expectations again from the JSON (after editing the renderers)
        doc = json.loads((HERE / "arch_report.json").read_text())
        (HERE / "arch_report.md").write_text(render(doc))
        (HERE / "arch_expect.py").write_text(expectations(doc))
        return
    types = argv or arch_zoo.MODEL_TYPES
    t0 = time.time()
    rows = collect(types, verbose=bool(argv))
    if argv:
        return
    import torch
    import transformers

    doc = {"transformers": transformers.__version__, "torch": torch.__version__, "new_tokens": NEW_TOKENS,
           "skipped": arch_zoo.SKIPPED, "seconds": round(time.time() - t0, 1), "types": rows}
    (HERE / "arch_report.json").write_text(dump(doc))
    (HERE / "arch_report.md").write_text(render(doc))
    (HERE / "arch_expect.py").write_text(expectations(doc))


def dump(doc: dict) -> str:
    """The JSON with one line per type (a regenerated report diffs per type)."""
    head = {k: v for k, v in doc.items() if k != "types"}
    rows = ",\n".join(json.dumps(r, separators=(",", ":")) for r in doc["types"])
    return json.dumps(head, indent=1)[:-2] + ',\n "types": [\n' + rows + "\n ]\n}\n"


def expectations(doc: dict) -> str:
    """``arch_expect.py``: the types by verdict (refusals with their reason, failures with what failed)."""
    exact, refused, failing = [], {}, {}
    for row in doc["types"]:
        t, v = row["model_type"], row.get("verdict", "failing")
        if v == "exact":
            exact.append(t)
        elif v == "refused":
            refused[t] = row["run"]["load"]["reason"]
        else:
            failing[t] = row.get("failure") or f"build: {row.get('build')}"
    lines = ['"""What our engine does with each zoo type today (generated by arch_report.py; do not edit by hand).',
             "",
             "EXACT: greedy ids equal HF's in every mode and prefix reuse equals re-prefilling (arch_run.py).",
             "REFUSED: type -> the one-line reason loading gives (an ``EngineError``).",
             "FAILING: type -> the first failure (engine bugs, strict xfails in test_arch_coverage: a fixed one turns",
             "the test red, so rerun arch_report.py, review the diff, commit).",
             '"""', "", "EXACT = {"]
    lines += textwrap.wrap(" ".join(f"{t!r}," for t in exact), 110, initial_indent="    ", subsequent_indent="    ",
                           break_on_hyphens=False)
    lines += ["}", "", "REFUSED = {"]
    lines += [f"    {t!r}: {v!r}," for t, v in refused.items()]
    lines += ["}", "", "FAILING = {"]
    lines += [f"    {t!r}: {v!r}," for t, v in failing.items()]
    lines += ["}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
