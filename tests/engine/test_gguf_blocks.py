"""GGUF files whose weights stay as blocks (``engine.quant``) through the engine: files written in the test with
every block type (``gguf_blocks``), loaded by ``load_model`` as a user opens them.

Exactness, the two roads: with float activations (``KVSCOPE_GGUF_ROAD=float``) the engine's greedy tokens equal HF
``generate``'s on the model the gguf package dequantizes from the same file; with 8-bit activations (the default,
llama.cpp's numerics) every lossless cache mode gives the tokens of the engine's own forward without a cache.
The weights are the file's mapping (no copy), the kept types are said before the load, a type without a kernel is
dequantized with one line naming it and the kept ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from gguf_blocks import ALL, cycle, write_blocks  # noqa: E402  (tests/engine is on sys.path)
from gguf_make import random_model  # noqa: E402
from test_exact import engine_greedy, hf_greedy  # noqa: E402

from engine.config import CacheConfig, ModelSpec  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.quant import gguf_keep, kernel  # noqa: E402
from engine.quant.modules import BlockEmbedding, BlockLinear  # noqa: E402

pytestmark = pytest.mark.skipif(kernel.library() is None, reason="no C compiler for the GGUF block kernels")

N = 16
BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES = {"llama": dict(tie_word_embeddings=False), "qwen2": dict(tie_word_embeddings=True),
          "gemma2": dict(head_dim=64, sliding_window=8, bos_token_id=2, eos_token_id=1)}
PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 79, 63, 115, 151]


def _random(arch: str):
    return random_model(arch, **{**BASE, **SHAPES[arch]})


@pytest.fixture(scope="module")
def files(tmp_path_factory, stories_path):
    """{arch: a GGUF whose 2-D weights cycle through every type (F32 ... Q6_K)}."""
    d = tmp_path_factory.mktemp("gguf-blocks")
    return {a: write_blocks(_random(a), a, stories_path / "tokenizer.model", d / f"{a}-mixed.gguf", cycle(ALL))
            for a in SHAPES}


def _hf_dequantized(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32)
    return model.eval()


class _Wrap:  # hf_greedy reads ``.model``
    def __init__(self, model):
        self.model = model


@pytest.mark.parametrize("arch", list(SHAPES))
def test_float_road_gives_hf_greedy_on_the_dequantized_model(files, arch, monkeypatch):
    monkeypatch.setenv("KVSCOPE_GGUF_ROAD", "float")
    lm = load_model(ModelSpec(source=str(files[arch])))
    kinds = {type(m) for m in lm.model.modules()}
    assert BlockLinear in kinds and BlockEmbedding in kinds
    assert f"GGUF {lm.info.weights_format}, mapped from the file (float activations" in lm.info.weights_kernel
    assert "bits per weight" not in lm.info.weights_kernel  # said once on the card: the weights row, as held
    ref = hf_greedy(_Wrap(_hf_dequantized(files[arch])), PROMPT, N)
    assert engine_greedy(lm, PROMPT, N, CacheConfig(mode="paged", page_size=4)) == ref
    with torch.inference_mode():  # the logits themselves: float tolerance
        ids = torch.tensor([PROMPT])
        got, want = lm.model(ids).logits, _hf_dequantized(files[arch])(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("arch", list(SHAPES))
def test_int8_road_cache_modes_equal_the_forward_without_cache(files, arch):
    lm = load_model(ModelSpec(source=str(files[arch])))
    assert "int8 activations" in lm.info.weights_kernel
    ref = engine_greedy(lm, PROMPT, N, CacheConfig(mode="off"))
    for cache in (CacheConfig(mode="contiguous"), CacheConfig(mode="paged", page_size=1),
                  CacheConfig(mode="paged", page_size=16)):
        assert engine_greedy(lm, PROMPT, N, cache) == ref, cache


def test_weights_are_the_files_mapping(files):
    path = files["llama"]
    lm = load_model(ModelSpec(source=str(path)))
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            spans.append((lo, hi))
    blocks = [m.weight for m in lm.model.modules() if isinstance(m, (BlockLinear, BlockEmbedding))]
    assert spans and blocks
    assert all(any(lo <= w.data_ptr() < hi for lo, hi in spans) for w in blocks)  # in place: no copy


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_repacked_weights_give_the_file_layouts_logits(files, arch):
    """On AVX-512 VNNI the integer road's Q4_0 / Q8_0 / Q4_K / Q6_K linears (AVX2 too) are repacked sixteen
    rows a group on a thread the load starts, the first product waiting for it (qwen2's tied head: the embedding's
    blocks, its pages let go, its rows looked up from the file): the same integer sums as the file's layout, the
    float steps in another order (within float32 rounding), the same greedy tokens."""
    from engine.quant import formats

    lm = load_model(ModelSpec(source=str(files[arch])))
    linears = [m for m in lm.model.modules() if isinstance(m, BlockLinear)]
    # packing on a thread of its own (BF16's float layout too: test_bf16_gguf_blocked)
    pending = [m for m in linears if (m.pending() or m.packed is not None) and m.layout is None]
    if not kernel.packs():
        assert not pending and "mapped from the file" in lm.info.weights_kernel
        pytest.skip("no packed product in this build (AVX-512 VNNI)")
    assert "repacked from the file" in lm.info.weights_kernel
    want = {formats.name(m.ggml_type) for m in linears if kernel.packs(m.ggml_type)}
    assert want and {formats.name(m.ggml_type) for m in pending} == want
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        got = lm.model(ids).logits
    packed = [m for m in linears if m.packed is not None and m.layout is None]
    assert packed == pending and not [m for m in linears if m.pending()]
    if arch == "qwen2":
        assert lm.model.get_output_embeddings() in packed
    tokens = engine_greedy(lm, PROMPT, N, CacheConfig(mode="paged", page_size=4))
    for m in packed:
        m.packed = None  # the file's layout, the row products
    with torch.inference_mode():
        want_logits = lm.model(ids).logits
    assert (got - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()
    assert tokens == engine_greedy(lm, PROMPT, N, CacheConfig(mode="paged", page_size=4))


def test_two_threads_give_the_same_tokens(files):
    lm = load_model(ModelSpec(source=str(files["qwen2"])))
    one = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = engine_greedy(lm, PROMPT, 8, CacheConfig(mode="paged", page_size=4))
        torch.set_num_threads(2)
        b = engine_greedy(lm, PROMPT, 8, CacheConfig(mode="paged", page_size=4))
    finally:
        torch.set_num_threads(one)
    assert a == b


def test_a_type_without_kernel_is_dequantized_and_named(tmp_path, stories_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_GGUF_ROAD", "float")

    def types(name, shape):
        return "Q3_K" if name.endswith("up_proj.weight") else "Q4_K" if shape[-1] % 256 == 0 else None
    path = write_blocks(_random("llama"), "llama", stories_path / "tokenizer.model", tmp_path / "q3.gguf", types)
    notes = []
    lm = load_model(ModelSpec(source=str(path)), progress=lambda m, f: notes.append(str(m)))
    note = next(n for n in notes if "stay as the file stores them" in n)
    assert "Q3_K weights have no block kernel and are dequantized (kept: F32, F16, BF16, Q4_0" in note
    up = lm.model.model.layers[0].mlp.up_proj
    assert type(up) is not BlockLinear and up.weight.dtype == torch.float32  # dequantized, then packed or not
    ref = hf_greedy(_Wrap(_hf_dequantized(path)), PROMPT, 8)
    assert engine_greedy(lm, PROMPT, 8, CacheConfig(mode="paged", page_size=4)) == ref


def test_a_tensor_past_the_end_is_refused(files, tmp_path):
    cut = tmp_path / "cut.gguf"
    shutil.copy(files["llama"], cut)
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 100)
    with pytest.raises(ValueError, match="past the end of the file"):
        gguf_keep.Table(cut)


@pytest.mark.slow
def test_the_compiled_step_runs_on_blocks_and_gives_the_eager_tokens(files, monkeypatch):
    """The compiled decode step's child builds the same block modules with throwaway weights (the package calls
    the block operators, the parent hands it the mapped weights): its tokens are eager's. Float activations: with
    8-bit ones the graph's other summation order (its fused norms) moves a value across a rounding step now and
    then, and a random model's near-tied logits follow it."""
    from engine.model.fast_step import FastStep, machine_refusal

    if machine_refusal(torch.device("cpu")):
        pytest.skip(machine_refusal(torch.device("cpu")))
    monkeypatch.setenv("KVSCOPE_GGUF_ROAD", "float")
    lm = load_model(ModelSpec(source=str(files["llama"])))
    eager = engine_greedy(lm, PROMPT, N, CacheConfig(mode="paged", page_size=4))
    lm.runner.fast = FastStep(lm, mode="on")
    lm.fast.start()
    assert lm.fast.wait(600) and lm.fast.state == "on", lm.fast.describe()
    s_paths = []
    from engine.config import SamplingConfig
    from engine.core.session import ChatSession

    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    s.start_ids(PROMPT, SamplingConfig(max_new_tokens=N, ignore_eos=True))
    while not (r := s.step()).done:
        if r.event is not None:
            s_paths.append(r.event.path)
    assert "compiled" in s_paths
    assert s.generated_ids == eager


def test_a_quantized_draft_model_speculates_for_a_quantized_target(files, tmp_path, stories_path, monkeypatch):
    """Speculative decoding with a Q4_K GGUF draft model for a mixed-block GGUF target: the target's own greedy
    tokens (the draft only proposes; float activations, so that a verification's rows and a decode's row are the
    same sums)."""
    from engine.config import SamplingConfig
    from engine.core.session import ChatSession
    from engine.speculation.draft_model import ModelDrafter
    from engine.core.verify import SpecConfig

    monkeypatch.setenv("KVSCOPE_GGUF_ROAD", "float")
    target = load_model(ModelSpec(source=str(files["llama"])))
    plain = engine_greedy(target, PROMPT, 24, CacheConfig(mode="paged", page_size=4))
    model = _random("llama")
    with torch.no_grad():
        for p in model.parameters():  # another model: the draft is wrong now and then
            p.mul_(1.1)
    path = write_blocks(model, "llama", stories_path / "tokenizer.model", tmp_path / "draft-q4k.gguf",
                        lambda name, shape: "Q4_K" if shape[-1] % 256 == 0 else "Q8_0")
    draft = load_model(ModelSpec(source=str(path)))
    assert any(isinstance(m, BlockLinear) and m.ggml_type == 12 for m in draft.model.modules())
    s = ChatSession(target, CacheConfig(mode="paged", page_size=4))
    s.speculate(SpecConfig(method="draft", draft_path=str(path), auto_off=False), ModelDrafter(draft, target))
    s.start_ids(PROMPT, SamplingConfig(max_new_tokens=24, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    assert s.generated_ids == plain
    assert r.stats.draft_tokens > 0
