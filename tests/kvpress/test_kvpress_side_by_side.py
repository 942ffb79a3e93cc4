"""Our Expected Attention, H2O and StreamingLLM beside kvpress's presses of the same methods (ExpectedAttentionPress,
ObservedAttentionPress, StreamingLLMPress) at the same compression, on stories260K's held-out stories and a
needle set built in code (``side_by_side``: the protocol, and where the methods differ).

kvpress 0.5.5 needs transformers < 5.3: it runs in a venv of its own (``kvpress_env``), made once by
``python tests/kvpress/kvpress_env.py`` (or here with ``KVSCOPE_KVPRESS=build``) and cached. Opt-in
(``KVSCOPE_KVPRESS=1``: ~30 s of CPU); skipped otherwise, or without the venv, saying how to run it. The
margins: perplexity ratio within 0.05 and top-1 agreement within 10
points of kvpress's (a needle set's answer is ~24 tokens: one token is 4 points), except for Expected Attention on
the needles, where ours keeps the name kvpress's press drops (both choosing per KV head, and both per layer in the
"/layer" variants: not the granularity; ours keeps a recent window and averages RoPE from the true next position):
there ours may be better, never worse by more than the margin.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvpress_env  # noqa: E402
import side_by_side as sbs  # noqa: E402

pytestmark = [pytest.mark.kvpress, pytest.mark.slow]
KEEPS = (0.5, 0.25)
PPL, TOP1 = 0.05, 0.10
METHODS = (*sbs.METHODS, "expected/layer")  # Expected Attention per KV head (default) and per layer, both sides
# ours keeps the needle kvpress's press drops; "/layer" is not kvpress's own press (our wrapper summing its heads'
# scores, ``kvpress_run.per_layer``): there ours is held to "never worse by more than the margin" too
ONE_SIDED = {("needle", "expected"), ("needle", "expected/layer"), ("story", "expected/layer")}


@pytest.fixture(scope="module")
def kvpress_python():
    wanted = os.environ.get("KVSCOPE_KVPRESS", "")
    if wanted not in ("1", "build"):  # ~30 s of CPU beside kvpress: not in the default run
        pytest.skip("the kvpress side-by-side is opt-in: KVSCOPE_KVPRESS=1 (from its cached venv) or =build (makes it "
                    "once, ~8 min from the package index); python -m tests.kvpress.measure prints the whole table")
    ready = kvpress_env.venv_dir() / ".kvscope-ready"
    if not ready.exists() and wanted != "build":
        pytest.skip(f"kvpress venv not made ({kvpress_env.venv_dir()}): `python tests/kvpress/kvpress_env.py` makes it "
                    "once from the package index (~8 min here), or KVSCOPE_KVPRESS=build")
    try:
        return kvpress_env.ensure_venv()
    except kvpress_env.VenvUnavailable as e:
        pytest.skip(str(e))


def test_ours_is_within_the_margin_of_kvpress_at_half_and_a_quarter_of_the_cache(kvpress_python, stories,
                                                                                   stories_path):
    import torch

    torch.set_grad_enabled(False)
    items = sbs.texts(stories.tokenizer, needles=8)
    theirs = sbs.run_theirs(kvpress_python, str(stories_path), items, KEEPS, METHODS)
    ours = sbs.run_ours(stories, items, KEEPS, METHODS)
    for key, t in theirs.items():
        assert "error" not in t, f"kvpress {key}: {t.get('error')}"
        o = ours[key]
        assert o["tokens"] == t["tokens"]  # the same scored tokens
        kind, method, _ = key
        if (kind, method) in ONE_SIDED:
            assert o["perplexity_ratio"] <= t["perplexity_ratio"] + PPL and o["top1"] >= t["top1"] - TOP1, (key, o, t)
        else:
            assert abs(o["perplexity_ratio"] - t["perplexity_ratio"]) <= PPL, (key, o, t)
            assert abs(o["top1"] - t["top1"]) <= TOP1, (key, o, t)
