"""A BF16 GGUF's linears in float32 compute held blocked (``packed_linear.BF16_BLOCKED_F32``): float32 rows times
bfloat16 blocked weights (``kvs_blocked_mm_xh`` in engine/native/csrc/blocked_linear.c) at every build level this CPU
runs, against float64; the blocks shared among two threads bit for bit; and real BF16 GGUF files (written in the
test, loaded as a user opens them) whose linears are blocked on the pack thread, the file's pages let go, with the
dequantized float32 model's logits and HF's greedy tokens on the float road, and the rows' product's numerics
(activations rounded to bfloat16 where the CPU has AVX512_BF16) on the default road.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from gguf_blocks import write_blocks  # noqa: E402  (tests/engine is on sys.path)
from test_exact import engine_greedy, hf_greedy  # noqa: E402
from test_gguf_op import cpp  # noqa: E402,F401  (the C++ kernel attached, the Python kernel's calls counted)

from engine.config import CacheConfig, ModelSpec, SamplingConfig  # noqa: E402
from engine.core.session import ChatSession  # noqa: E402
from engine.model import linear_kernel, packed_linear  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.packed_linear import block  # noqa: E402
from engine.native import build  # noqa: E402
from engine.quant import gguf_keep, kernel  # noqa: E402
from engine.quant.modules import BlockLinear  # noqa: E402

pytestmark = pytest.mark.skipif(linear_kernel.LINEAR.library() is None or kernel.library() is None,
                                reason="no native kernels here")
PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 79, 63, 115, 151]
N = 16
# the build levels: this CPU's own (AVX512_BF16 here: pairs), AVX-512 without it, AVX2 (its 256-bit path), portable
LEVELS = {"native": build.TUNE, "avx512": ("-march=x86-64-v4",), "avx2": ("-march=x86-64-v3",), "portable": ()}
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma")}


def _xh(lib, x: torch.Tensor, wb: torch.Tensor, b: torch.Tensor | None, rounded: bool) -> torch.Tensor:
    rows, nb = x.shape[0], wb.shape[0]
    y = torch.full((rows, nb * 16), float("nan"))
    xb = x.bfloat16() if rounded else None
    rc = lib.kvs_blocked_mm_xh(rows, x.shape[1], 0, nb, x.data_ptr(), xb.data_ptr() if rounded else None,
                               wb.data_ptr(), b.data_ptr() if b is not None else None, y.data_ptr(), nb * 16)
    assert rc == 0
    return y


@pytest.mark.parametrize("level", list(LEVELS))
def test_float32_rows_times_bfloat16_blocks_at_every_level(level):
    """One row (decode) and many (groups of eight or six and a rest), widths on and off the vectors (an odd last
    input outside the pairs), with and without a bias: float32 rows give the float64 product of the float32 rows and
    the bfloat16 weights within float32 summation; ``rounded`` gives that of the rows rounded to bfloat16 — each
    ~1e-3 away from the other's, so neither passes for the other."""
    if level in NEEDS and not all(f in build.cpu_flags() for f in NEEDS[level]):
        pytest.skip(f"this CPU runs no {level} build")
    lib = linear_kernel.LINEAR.library() if level == "native" else linear_kernel.LINEAR.load(LEVELS[level])
    g = torch.Generator().manual_seed(7)
    for out, n_in in ((16, 7), (48, 33), (960, 576)):
        w = torch.randn(out, n_in, generator=g).bfloat16()
        wb, wd = block(w), w.double()
        for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 70):
            x = torch.randn(rows, n_in, generator=g)
            for b in (torch.randn(out, generator=g), None):
                bd = b.double() if b is not None else 0
                for rounded in (False, True):
                    ref = (x.bfloat16() if rounded else x).double() @ wd.T + bd  # [rows, out]
                    got = _xh(lib, x, wb, b, rounded)
                    err = (got.double() - ref).abs().max().item()
                    assert err <= 1e-5 * ref.abs().max().item(), (level, out, n_in, rows, b is None, rounded, err)


def test_the_python_product_and_the_operator_share_the_blocks_bit_for_bit():
    """``linear_kernel.float_product`` on one thread is the library's call; on two, the C++ operators' library
    shares the blocks among them (``PARALLEL_XH``), every block summed as on one: the same bits, both roads' numerics.
    ``kvscope::blocked_linear`` takes the pair too (float32 rows): its C++ kernel gives its Python kernel's bits."""
    from engine.model import linear_op

    if not linear_op.attach():
        pytest.skip(f"no C++ operators here: {linear_op.why()}")
    assert linear_kernel.PARALLEL_XH is not None
    g = torch.Generator().manual_seed(2)
    wb, b = block(torch.randn(960, 576, generator=g).bfloat16()), torch.randn(960, generator=g)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 4, 70):
            x = torch.randn(rows, 576, generator=g)
            for rounded in (False, True):
                torch.set_num_threads(1)
                one = linear_kernel.float_product(x, wb, b, rounded)
                assert torch.equal(one, _xh(linear_kernel.LINEAR.library(), x, wb, b, rounded))
                torch.set_num_threads(2)
                assert torch.equal(linear_kernel.float_product(x, wb, b, rounded), one)
            assert torch.equal(torch.ops.kvscope.blocked_linear(x, wb, b), linear_kernel.float_product(x, wb, b))
            assert torch.equal(linear_kernel.blocked_product(x, wb, b), linear_kernel.float_product(x, wb, b))
    finally:
        torch.set_num_threads(threads)


def _random(arch: str, tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tied)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory, stories_path):
    """{arch: a BF16 GGUF (every 2-D weight BF16, norms F32)}: llama untied (its query / key rows in llama.cpp's
    order: a row map), qwen2 tied (the head is the embedding's blocks)."""
    import gguf

    d = tmp_path_factory.mktemp("bf16-gguf")
    return {a: write_blocks(_random(a, tied), a, stories_path / "tokenizer.model", d / f"{a}-bf16.gguf",
                            lambda name, shape: "BF16", file_type=gguf.LlamaFileType.MOSTLY_BF16)
            for a, tied in (("llama", False), ("qwen2", True))}


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32).eval()


class _Wrap:  # hf_greedy reads ``.model``
    def __init__(self, model):
        self.model = model


def _resident(path: Path) -> int:
    """Bytes of the file's mapping resident in this process."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_road_blocks_every_linear_with_the_dequantized_models_logits(files, arch, monkeypatch):
    """Float activations: every linear (qwen2's tied head too) blocked with float32 rows, the model card says so,
    the file's pages let go once blocked; the logits within float32 rounding of the gguf package's dequantized
    float32 model, HF's greedy tokens."""
    monkeypatch.setenv("KVSCOPE_GGUF_ROAD", "float")
    lm = load_model(ModelSpec(source=str(files[arch])))
    linears = [m for m in lm.model.modules() if isinstance(m, BlockLinear)]
    assert len(linears) == 2 * 7 + 1 and all(m.layout is packed_linear.BF16_BLOCKED_F32 for m in linears)
    assert lm.info.weights_kernel.startswith("GGUF BF16, blocked from the file")
    assert ", blocked from the file (float activations" in lm.info.weights_kernel
    ids = torch.tensor([PROMPT])
    hf = _hf(files[arch])
    with torch.inference_mode():
        got, want = lm.model(ids).logits, hf(ids).logits
        one, want_one = lm.model(ids[:, :1]).logits, hf(ids[:, :1]).logits
    assert all(m.packed is not None and m.packed.shape == (m.out_features // 16, m.in_features, 16) for m in linears)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (one - want_one).abs().max() <= 1e-5 * want_one.abs().max()
    size = files[arch].stat().st_size
    assert _resident(files[arch]) < size // 4  # the linears' pages let go (the lookups read a few rows)
    assert engine_greedy(lm, PROMPT, N, CacheConfig(mode="paged", page_size=4)) == hf_greedy(_Wrap(hf), PROMPT, N)


def test_default_road_keeps_the_rows_products_numerics(files, monkeypatch):
    """The default road: the rows rounded to bfloat16 where the rows' product rounds them (AVX512_BF16), else
    float32; within float32 summation of the rows' product at a decode row, the same greedy tokens. Without the
    library's float32-rows product (a library prebuilt before it) the rows' product stays, mapped."""
    monkeypatch.delenv("KVSCOPE_GGUF_ROAD", raising=False)
    path = files["llama"]
    lm = load_model(ModelSpec(source=str(path)))
    rounded = kernel.default_road() == "int8" and bool(kernel.library().kq_gemm_float_pairs(30, 0))
    layout = packed_linear.BF16_BLOCKED_F32_ROUNDED if rounded else packed_linear.BF16_BLOCKED_F32
    assert all(m.layout is layout for m in lm.model.modules() if isinstance(m, BlockLinear))
    assert "blocked from the file" in lm.info.weights_kernel
    monkeypatch.setattr(linear_kernel, "takes_float", lambda: False)
    rows = load_model(ModelSpec(source=str(path)))
    assert all(m.layout is None for m in rows.model.modules() if isinstance(m, BlockLinear))
    assert "mapped from the file" in rows.info.weights_kernel
    ids = torch.tensor([PROMPT[:1]])
    with torch.inference_mode():
        got, want = lm.model(ids).logits, rows.model(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    cache = CacheConfig(mode="paged", page_size=4)
    assert engine_greedy(lm, PROMPT, N, cache) == engine_greedy(rows, PROMPT, N, cache)


def test_the_plan_counts_the_blocked_copy_not_the_mapping(files, monkeypatch):
    """What the loader says before the weights are read: the linears' bytes held in the process (the blocked copy),
    not mapped; without the float32-rows product, mapped."""
    from engine.model.gguf_file import read_gguf

    from engine.model.packed_linear import gguf_float_layout

    info = read_gguf(files["qwen2"])
    blocked = gguf_keep.plan(info, "cpu", 4, gguf_float_layout(torch.float32, "cpu"))  # as the loader asks
    assert blocked.blocked and blocked.where == "blocked from the file"
    monkeypatch.setattr(linear_kernel, "takes_float", lambda: False)
    assert gguf_float_layout(torch.float32, "cpu") is None
    mapped = gguf_keep.plan(info, "cpu", 4, gguf_float_layout(torch.float32, "cpu"))
    assert not mapped.blocked and mapped.where == "mapped from the file"
    assert blocked.mapped + blocked.copied == mapped.mapped + mapped.copied
    assert blocked.copied - mapped.copied == 2 * 256 * (2 * (256 + 128 + 128 + 256 + 3 * 512) + 512)  # linears, head


@pytest.mark.parametrize("rounded", [False, True])
def test_the_compiled_steps_operator_answers_a_blocked_owner_in_cpp(cpp, rounded):
    """``kvscope::gguf_linear`` on a blocked owner's weight: the first call is Python's (the owner's product), which
    offers its blocked copy; from then on the C++ kernel answers (no Python call) with the same bits — a bias, a row
    map (llama's query rows), one row and many, one thread and two; a module changed goes back to Python."""
    from test_gguf_kernels import blocks

    from engine.quant import gguf_op

    if linear_kernel.PARALLEL_XH is None:
        pytest.skip("the C++ operators have no float32-rows product")
    n, out = 96, 64
    g = torch.Generator().manual_seed(5)
    order = torch.randperm(out, generator=g).to(torch.int32)
    lin = BlockLinear(torch.from_numpy(blocks("BF16", out, n)), 30, n, torch.randn(out, generator=g), order)
    lin.layout = packed_linear.BF16_BLOCKED_F32_ROUNDED if rounded else packed_linear.BF16_BLOCKED_F32
    assert lin.pack()
    op = torch.ops.kvscope.gguf_linear
    threads, start = torch.get_num_threads(), cpp[0]
    try:
        for rows in (1, 5, 40):
            x = torch.randn(rows, n, generator=g)
            torch.set_num_threads(1)
            want = lin(x)
            assert torch.equal(op(x, lin.weight, 30, n, lin.bias, lin.out_map, 0), want) and gguf_op.size() == 1
            for th in (1, 2):
                torch.set_num_threads(th)
                assert torch.equal(op(x, lin.weight, 30, n, lin.bias, lin.out_map, 0), want)
    finally:
        torch.set_num_threads(threads)
    assert cpp[0] == start + 1  # Python's first call only: the table holds the owner whatever the rows
    lin.bias = torch.nn.Parameter(torch.zeros(out), requires_grad=False)
    assert gguf_op.size() == 0
    before = cpp[0]
    assert torch.equal(op(x, lin.weight, 30, n, lin.bias, lin.out_map, 0), lin(x))
    assert cpp[0] == before + 1


@pytest.mark.slow
def test_the_compiled_step_on_blocked_linears_gives_the_no_cache_tokens(files, monkeypatch):
    """A compiled decode step (its package built in a child, ~20-40 s) on the blocked BF16 linears gives the tokens
    of the forward without a cache; where the C++ operators load, every block linear's product is answered from
    their table (the blocked owners' copies, no Python call a product). The float road: activations rounded to
    bfloat16 (the default road on AVX512_BF16, the rows' product's too) turn the compiled attention's last-bit
    differences into ~1e-3 of a layer's output (a 4-layer 2048-wide BF16 file's greedy tokens part after 8)."""
    monkeypatch.setenv("KVSCOPE_GGUF_ROAD", "float")
    from engine.model import linear_op
    from engine.model.fast_step import FastStep, machine_refusal
    from engine.quant import gguf_op

    if machine_refusal(torch.device("cpu")):
        pytest.skip(f"cannot compile here: {machine_refusal(torch.device('cpu'))}")
    lm = load_model(ModelSpec(source=str(files["llama"])))
    ref = engine_greedy(lm, PROMPT, N, CacheConfig(mode="off"))
    lm.runner.fast = FastStep(lm, mode="on")
    lm.fast.start()
    assert lm.fast.wait(600) and lm.fast.state == "on", lm.fast.describe()
    gguf_op.forget()
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    s.start_ids(PROMPT, SamplingConfig(max_new_tokens=N, ignore_eos=True))
    paths = []
    while not (r := s.step()).done:
        if r.event is not None:
            paths.append(r.event.path)
    s.close()
    assert "compiled" in paths and s.generated_ids == ref
    if linear_op.loaded() and linear_kernel.PARALLEL_XH is not None:
        assert gguf_op.size() == sum(isinstance(m, BlockLinear) for m in lm.model.modules())


def test_a_process_exits_cleanly_with_the_table_full():
    """The table's entries hold their weights' storages (numpy's, a file mapping's: Python objects); left to the C++
    library's exit they were let go after Python was gone (a segmentation fault at the end of every such process):
    emptied at Python's exit instead."""
    from engine.model import linear_op

    if not linear_op.attach():
        pytest.skip(f"no C++ operators here: {linear_op.why()}")
    code = """if True:
        import torch
        from test_gguf_kernels import blocks
        from engine.model import linear_op, packed_linear
        from engine.quant import gguf_op
        from engine.quant.modules import BlockLinear
        assert linear_op.attach()
        lin = BlockLinear(torch.from_numpy(blocks("BF16", 32, 64)), 30, 64)  # the rows: numpy's storage
        lin.layout = packed_linear.BF16_BLOCKED_F32
        assert lin.pack()
        x = torch.randn(1, 64)
        for _ in range(2):
            torch.ops.kvscope.gguf_linear(x, lin.weight, 30, 64, None, None, 0)
        print("entries", gguf_op.size())
        """
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": f"{here.parents[1]}:{here}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "entries 1" in r.stdout, (r.returncode, r.stderr[-2000:])
