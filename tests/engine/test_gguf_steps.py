"""The compiled steps on a GGUF's repacked weights with 8-bit activations (the default road): the compiled decode
step and the compiled batched step give the greedy tokens of the engine's own forward without a cache on the same
weights, in every lossless cache mode they run.

The file is written in the test (``gguf_blocks``: a random llama whose linears cycle through the types the integer
road repacks, Q4_0, Q8_0, Q4_K and Q6_K); each package is built in a child process (~20-40 s each on the project's
2-core machine), so the module is slow.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from gguf_blocks import cycle, write_blocks  # noqa: E402  (tests/engine is on sys.path)
from test_exact import engine_greedy  # noqa: E402
from test_gguf_blocks import PROMPT, _random  # noqa: E402

from engine.config import CacheConfig, ModelSpec, SamplingConfig  # noqa: E402
from engine.core import scheduler as batch  # noqa: E402
from engine.core.session import ChatSession  # noqa: E402
from engine.model import linear_op  # noqa: E402
from engine.model.fast_step import FastStep, machine_refusal  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.quant import gguf_op, kernel  # noqa: E402
from engine.quant.modules import BlockLinear  # noqa: E402

NO_COMPILE = machine_refusal(torch.device("cpu"))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(kernel.library() is None, reason="no C compiler for the GGUF block kernels"),
              pytest.mark.skipif(bool(NO_COMPILE), reason=f"cannot compile here: {NO_COMPILE}")]
N = 16
PROMPTS = [PROMPT, [1, 261, 376, 79, 63], [1, 115, 151, 403, 407, 261, 378, 432, 383]]


@pytest.fixture(scope="module")
def lm(tmp_path_factory, stories_path):
    path = tmp_path_factory.mktemp("gguf-steps") / "llama-packed.gguf"
    write_blocks(_random("llama"), "llama", stories_path / "tokenizer.model", path,
                 cycle(("Q4_K", "Q8_0", "Q4_0", "Q6_K")))
    m = load_model(ModelSpec(source=str(path)))
    assert "int8 activations" in m.info.weights_kernel
    m.runner.fast = FastStep(m, mode="on")
    return m


@pytest.fixture(scope="module")
def refs(lm):
    """Each prompt's greedy tokens from the forward without a cache (its first product packs the weights)."""
    out = [engine_greedy(lm, p, N, CacheConfig(mode="off")) for p in PROMPTS]
    linears = [m for m in lm.model.modules() if isinstance(m, BlockLinear)]
    assert [m.packed is not None for m in linears] == [kernel.packs(m.ggml_type) for m in linears]
    return out


def _paths(lm, prompt, cache):
    s = ChatSession(lm, cache)
    s.start_ids(prompt, SamplingConfig(max_new_tokens=N, ignore_eos=True))
    paths = []
    try:
        while not (r := s.step()).done:
            if r.event is not None:
                paths.append(r.event.path)
        return s.generated_ids, paths
    finally:
        s.close()


def test_the_compiled_step_gives_the_no_cache_tokens(lm, refs):
    """... and where the C++ operators load, the step's block products are answered by the C++ kernel from its
    table (an entry for each block linear the step calls: its packed copy's descriptor)."""
    lm.fast.start()
    assert lm.fast.wait(600) and lm.fast.state == "on", lm.fast.describe()
    for cache in (CacheConfig(mode="paged", page_size=4), CacheConfig(mode="paged", page_size=16)):
        ids, paths = _paths(lm, PROMPTS[0], cache)
        assert "compiled" in paths, paths
        assert ids == refs[0], cache
    if linear_op.loaded():
        assert gguf_op.size() == sum(isinstance(m, BlockLinear) for m in lm.model.modules())


def test_the_compiled_batch_gives_each_chat_its_no_cache_tokens(lm, refs):
    b = lm.fast.batch
    b.set_mode("on")
    b.start()
    assert b.wait(600) and b.state == "on", b.describe()
    sessions = [ChatSession(lm, CacheConfig(page_size=8)) for _ in PROMPTS]
    paths = {id(s): [] for s in sessions}
    try:
        for s, p in zip(sessions, PROMPTS):
            s.start_ids(p, SamplingConfig(max_new_tokens=N, ignore_eos=True))
        while live := [s for s in sessions if s.generating]:
            for s, r in zip(live, batch.step_all(live)):
                if r.event is not None:
                    paths[id(s)].append(r.event.path)
        assert [s.generated_ids for s in sessions] == refs
    finally:
        for s in sessions:
            s.close()
    assert all("compiled batch" in paths[id(s)] for s in sessions), [paths[id(s)] for s in sessions]
