"""The closing note's TurboQuant comparison: the ``turboquant`` package (0.2.0) and ours at 4, 3 and 2 bits on
stories260K's held-out text (511 tokens, teacher-forced, each against its own full-precision cache), one table.

Run: ``python tests/engine/measure_turboquant.py [--json FILE]`` (the first run makes the package's venv, ~1 min;
each reference row then takes ~1 min here). ``tests/engine/test_tq_reference.py`` asserts the margins
(``KVSCOPE_REFERENCE=1``).
"""

from __future__ import annotations

import json
import sys

import turboquant_env as env


def main(argv: list[str]) -> int:
    import torch

    from engine.model.fast_step import FastStep
    from engine.model.loader import load_model

    torch.set_grad_enabled(False)
    py = env.ensure_venv(lambda m: print("venv:", m, file=sys.stderr))
    ids = env.token_ids()
    lm = load_model(str(env.STORIES))
    lm.runner.fast = FastStep(lm, mode="off")
    ours = {r["k_dtype"]: r for r in env.our_rows(lm, ids)}
    theirs = env.reference_rows(py, ids)
    print("perplexity × and top-1 agreement against each side's own full-precision cache, 511 tokens")
    print(f"{'bits':>4} {'ours':>16} | turboquant: {'our page policy':>16} {'16 exact':>16} {'128 exact':>16}")
    cell = lambda r: f"×{r['perplexity_ratio']:<7.4f} {r['top1_agreement'] * 100:5.1f}%"  # noqa: E731
    for b in (4, 3, 2):
        t = {r["residual"]: r for r in theirs if r["bits"] == b}
        print(f"{b:>4} {cell(ours[f'tq{b}']):>16} |             {cell(t[-16]):>16} {cell(t[16]):>16} {cell(t[128]):>16}")
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump({"ours": list(ours.values()), "turboquant": theirs, "tokens": len(ids)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
