"""``--quantize nf4`` on a CPU multiplied by the block kernels (``engine.model.nf4_quant.to_blocks``): bitsandbytes'
NF4 codes regrouped in Q4_0's layout with the codebook times 127 rounded to int8 (``engine.quant.formats.NF4``).

The stored codes are bitsandbytes' own (read back nibble by nibble); the table is off NF4's float levels by at most
0.5 / 127 of a block's absmax; the product is exact on 8-bit activation blocks against a float64 reference of the
same rounded table (row products, the many-rows GEMM, the packed product), within the integer road's error of
bitsandbytes' own dequantized float product; a loaded model holds one copy of its 4-bit weights, what the fit
verdict said, and its paged cache's greedy tokens are the same model's own no-cache forward's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, ModelSpec
from engine.model import fit, nf4_quant
from engine.quant import formats, kernel

bnb = pytest.importorskip("bitsandbytes")
gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not nf4_quant.available("cpu"), reason="no block kernels on this machine")

NF4 = formats.NF4


def nf4_levels() -> np.ndarray:
    from bitsandbytes.functional import get_4bit_type

    return get_4bit_type("nf4", device="cpu").double().numpy()  # [16], bitsandbytes' codebook


def table() -> np.ndarray:
    """The kernels' int8 table, read back through the library's dequantize: one block of codes 0..15, d = 1."""
    blk = np.zeros(18, np.uint8)
    blk[:2] = np.array([1.0], np.float16).view(np.uint8)
    blk[2:10] = np.arange(8) | (np.arange(8, 16) << 4)  # element j: code j (low nibbles), 16 + j: code 8 + j
    deq = kernel.dequantize(torch.from_numpy(blk).reshape(1, 18), NF4, 32).numpy()[0]
    return np.concatenate([deq[:8], deq[16:24]])


def linear4bit(n_out: int, n_in: int, nested: bool = False, seed: int = 0, bias: bool = False):
    from bitsandbytes.nn import Linear4bit

    nf4_quant.install()
    g = torch.Generator().manual_seed(seed)
    m = Linear4bit(n_in, n_out, bias=bias, compress_statistics=nested, quant_type="nf4")
    m.weight.data = torch.randn(n_out, n_in, generator=g) * 0.05
    if bias:
        m.bias.data = torch.randn(n_out, generator=g)
    return m.to("cpu").eval()  # quantized as it moves (bitsandbytes' Params4bit)


def bnb_float(m) -> torch.Tensor:
    """bitsandbytes' own dequantized weight, float32 [out, in]."""
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(m.weight.data, m.weight.quant_state).float()


def codes(q: np.ndarray) -> np.ndarray:
    """bitsandbytes' packed codes -> one code a weight (the even element in the high nibble)."""
    return np.stack([q >> 4, q & 0xF], -1).reshape(-1)


def reference(m, tab: np.ndarray) -> np.ndarray:
    """The weight as the kernels' table values it, float64, from bitsandbytes' codes and scales directly."""
    qs = m.weight.quant_state
    c = codes(m.weight.data.view(torch.uint8).numpy().reshape(-1)).reshape(qs.shape)
    absmax = nf4_quant._absmax(qs).numpy().repeat(qs.blocksize)[:c.size].reshape(qs.shape)  # a short last block
    d = (absmax / 127).astype(np.float16).astype(np.float64)
    return tab[c] * d


def q8(x: np.ndarray) -> np.ndarray:
    """x as the integer road's activation blocks value it (ggml's Q8_0), float64."""
    b = gguf.quants.quantize(x.astype(np.float32), gguf.GGMLQuantizationType.Q8_0).reshape(x.shape[0], -1, 34)
    d = b[:, :, :2].copy().view(np.float16).astype(np.float64)
    return (b[:, :, 2:].view(np.int8) * d).reshape(x.shape)


def test_the_table_is_nf4_times_127_rounded():
    levels, tab = nf4_levels(), table()
    assert np.array_equal(tab, np.rint(levels * 127))
    assert np.abs(tab / 127 - levels).max() <= 0.5 / 127  # the rounding's bound, in units of a block's absmax
    assert tab[0] == -127 and tab[7] == 0 and tab[15] == 127  # the ends and zero exact


@pytest.mark.parametrize("nested", [False, True])
def test_blocks_keep_bitsandbytes_codes(nested):
    """The rows hold bitsandbytes' codes nibble for nibble (in Q4_0's order), each scale its absmax / 127 in half
    precision (double-quantized scales dequantized first); dequantized, within the table's and the half's rounding
    of bitsandbytes' own float weight."""
    m = linear4bit(48, 256, nested)
    rows = nf4_quant.blocks_of(m)
    assert rows.shape == (48, 256 // 32 * 18) and rows.dtype == torch.uint8
    blk = rows.numpy().reshape(48, 8, 18)
    ours = np.concatenate([blk[:, :, 2:] & 0xF, blk[:, :, 2:] >> 4], -1).reshape(-1)  # element j low, 16 + j high
    assert np.array_equal(ours, codes(m.weight.data.view(torch.uint8).numpy().reshape(-1)))
    tab = table()
    deq = kernel.dequantize(rows, NF4, 256).double().numpy()
    assert np.array_equal(deq, reference(m, tab))
    absmax = nf4_quant._absmax(m.weight.quant_state).double().numpy().repeat(64).reshape(48, 256)
    err = np.abs(deq - bnb_float(m).double().numpy())
    assert (err <= absmax * (0.5 / 127 + 2.0 ** -11) + 1e-12).all()


@pytest.mark.parametrize("m_rows", [1, 7, 37])
def test_products_are_exact_on_the_quantized_activations(m_rows):
    """Row products (1, 7 rows), the GEMM (37: tiles of sixteen), the packed product: the integer sums of the same
    rounded table on ggml's Q8_0 activation blocks, float rounding apart; one row alone is the same row of many."""
    m = linear4bit(40, 544, seed=2, bias=True)  # 17 blocks: an odd last one; 40 rows: a short last group of 16
    rows = nf4_quant.blocks_of(m)
    x = torch.randn(m_rows, 544, generator=torch.Generator().manual_seed(3))
    bias = m.bias.detach().float()
    ref = q8(x.numpy()) @ reference(m, table()).T + bias.double().numpy()
    tol = 2e-6 * np.abs(ref).max()
    y = kernel.matmul(x, rows, NF4, 544, bias=bias, road="int8").numpy()
    assert np.abs(y - ref).max() <= tol
    packed = kernel.pack(rows, NF4, 544)
    if packed is not None:
        yp = kernel.matmul(x, rows, NF4, 544, bias=bias, road="int8", packed=packed).numpy()
        assert np.abs(yp - ref).max() <= tol
        one = np.stack([kernel.matmul(x[i:i + 1], rows, NF4, 544, bias=bias, packed=packed).numpy()[0]
                        for i in range(m_rows)])
        assert np.array_equal(one, yp)
        assert torch.equal(kernel.unpack(packed, NF4, 40, 544), rows)
    yf = kernel.matmul(x, rows, NF4, 544, bias=bias, road="float").numpy()  # float activations, the same table
    assert np.abs(yf - (x.double().numpy() @ reference(m, table()).T + bias.double().numpy())).max() <= tol


def test_the_module_is_bitsandbytes_product_within_the_integer_road():
    """The ``BlockLinear`` that replaces a ``Linear4bit`` against bitsandbytes' own float product (its dequantized
    weight times the float activations): the 8-bit activations and the rounded table cost ~1% of the output's
    largest value (0.7% and 1.1% here; bitsandbytes' own CPU kernel, bfloat16 activations and scales, 0.3% and
    0.6%)."""
    model = torch.nn.Sequential(linear4bit(64, 512, seed=4, bias=True), linear4bit(96, 64, nested=True, seed=5))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = [x @ bnb_float(model[0]).T + model[0].bias.float()]
        want.append(want[0] @ bnb_float(model[1]).T)
    assert nf4_quant.to_blocks(model) == 2
    assert [type(m).__name__ for m in model] == ["BlockLinear", "BlockLinear"]
    with torch.no_grad():
        got = [model[0](x)]
        got.append(model[1](got[0]))
    for g, w in zip(got, want):
        rel = ((g - w).abs().max() / w.abs().max()).item()
        assert rel <= 0.02, rel


def test_packed_only_holds_one_copy_and_reads_its_rows_back():
    m = linear4bit(64, 256, seed=7)
    rows = nf4_quant.blocks_of(m)
    from engine.quant.modules import BlockLinear

    b = BlockLinear(rows.clone(), NF4, 256)
    x = torch.randn(3, 256)
    before = b(x)
    if not b.hold_packed_only():
        pytest.skip("no packed product in this build")
    assert b.rows_packed and b.weight.data_ptr() == b.packed.data_ptr() and b.weight.shape == rows.shape
    assert b.held_bytes() == b.packed.numel() == rows.numel()  # 16-row groups, 64-weight steps: no padding
    assert torch.equal(b.rows(), rows)
    assert (b(x) - before).abs().max() <= 2e-6 * before.abs().max()  # the packed product: the same integer sums
    b.to(torch.float32)  # a no-op for uint8 weights: still packed only
    assert b.rows_packed
    c = b.to("meta")  # moved: the rows' layout back first
    assert not c.rows_packed and c.weight.is_meta and tuple(c.weight.shape) == tuple(rows.shape)


@pytest.fixture(scope="module", params=["avx2", "portable"])
def other_build(request, tmp_path_factory):
    """The kernels built for the installers' AVX2 level (x86-64-v3) or for no vector extension at all (x86-64:
    the portable C), loaded beside this build's."""
    import ctypes

    from engine.native import build
    from engine.native.libraries import KQ

    if request.param == "avx2":
        flags, need = next((f, need) for name, f, need in build.LEVELS if name == "avx2")
    else:
        flags, need = ("-march=x86-64",), ()
    cc = build.compiler(False)
    if cc is None or not all(f in build.cpu_flags() for f in need) or "x86_64" not in __import__("platform").machine():
        pytest.skip("no C compiler, or not an x86-64 CPU that runs the level")
    out = tmp_path_factory.mktemp("kq-" + request.param) / f"kq-{request.param}.so"
    build.compile_library(KQ, cc, flags, out)
    return request.param, kernel._declare(ctypes.CDLL(str(out)))


@pytest.mark.slow  # builds the library twice (~10-30 s each here)
def test_avx2_and_portable_builds_sum_alike(other_build):
    """An AVX2-only machine (maddubs with ggml's sign trick: the table's bytes are signed) and a CPU without vector
    extensions (the portable C, the table by index) multiply NF4 rows with the same integer sums; AVX2 multiplies
    them repacked too (as Q4_0's sixteen rows a group), the same sums."""
    level, lib = other_build
    assert lib.kq_isa_name() == (b"AVX2" if level == "avx2" else b"portable C")
    m = linear4bit(21, 544, seed=9, bias=True)
    rows = nf4_quant.blocks_of(m)
    x = torch.randn(7, 544, generator=torch.Generator().manual_seed(9))
    bias = m.bias.detach().float().contiguous()
    y = torch.empty(7, 21)
    assert lib.kq_matmul(NF4, rows.data_ptr(), rows.stride(0), 21, 544, x.data_ptr(), 7, 544, y.data_ptr(), 21,
                         bias.data_ptr(), None, 0, 1) == 0
    ref = q8(x.numpy()) @ reference(m, table()).T + bias.double().numpy()
    assert np.abs(y.numpy() - ref).max() <= 2e-6 * np.abs(ref).max()
    nbytes = lib.kq_pack_bytes(NF4, 21, 544)
    assert (nbytes > 0) == (level == "avx2")
    if nbytes:
        p = torch.empty(nbytes, dtype=torch.uint8)
        assert lib.kq_pack(NF4, rows.data_ptr(), rows.stride(0), 21, 544, p.data_ptr(), 1) == 0
        yp = torch.empty(7, 21)
        assert lib.kq_packed_matmul(NF4, p.data_ptr(), 21, 544, x.data_ptr(), 7, 544, yp.data_ptr(), 21,
                                    bias.data_ptr(), None, 1) == 0
        assert np.abs(yp.numpy() - ref).max() <= 2e-6 * np.abs(ref).max()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, stories_path):
    from test_fit import _folder  # tests/engine is on sys.path

    return _folder(tmp_path_factory.mktemp("nf4") / "llama-bf16", stories_path)


def no_cache_greedy(lm, ids: list[int], n: int) -> list[int]:
    """The model's own forward over the whole sequence at every step (no cache), the same kernels."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = lm.model(torch.tensor([out]), use_cache=False).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


def test_nf4_load_holds_blocks_and_decodes_as_its_no_cache_forward(folder):
    from test_exact import engine_greedy

    from engine.model.loader import load_model

    spec = ModelSpec(source=str(folder), quantization="nf4", device="cpu")
    verdict = fit.estimate_path(folder, spec, "cpu")
    lm = load_model(spec)
    kinds = [type(m).__name__ for m in lm.model.modules()]
    assert kinds.count("BlockLinear") == 2 * 7 and "Linear4bit" not in kinds  # every layer linear; not lm_head
    assert type(lm.model.lm_head).__name__ == "Linear"
    blocks = [m for m in lm.model.modules() if type(m).__name__ == "BlockLinear"]
    assert {m.ggml_type for m in blocks} == {NF4}
    if kernel.packs(NF4):
        blocks[0].pack_pending()  # (the folder's mapped load packs on a thread after the load: done now)
        assert all(m.rows_packed for m in blocks)  # one copy of the 4-bit weights
    assert (lm.info.weights_format, lm.info.weights_held) == ("NF4", "quantized")
    assert 0 <= verdict.weights.bytes - lm.info.weights_bytes <= 64 * 2 * 7  # bitsandbytes' codebook, per linear
    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]
    assert engine_greedy(lm, prompt, 12, CacheConfig()) == no_cache_greedy(lm, prompt, 12)


def test_a_model_with_bitsandbytes_linears_never_compiles(stories_path):
    """stories260K's MLP width (172) fits no NF4 block: those linears stay bitsandbytes', so the step stays eager."""
    from engine.model.loader import load_model

    lm = load_model(ModelSpec(source=str(stories_path), quantization="nf4", device="cpu"))
    assert "Linear4bit" in {type(m).__name__ for m in lm.model.modules()}
    assert "bitsandbytes" in lm.fast.model_refusal()


def test_bitsandbytes_nf4_on_request(folder, monkeypatch):
    monkeypatch.setenv(nf4_quant.ENV, "bitsandbytes")
    assert not nf4_quant.available("cpu")
    from engine.model.loader import load_model

    lm = load_model(ModelSpec(source=str(folder), quantization="nf4", device="cpu"))
    kinds = {type(m).__name__ for m in lm.model.modules()}
    assert "Linear4bit" in kinds and "BlockLinear" not in kinds


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantized_block_linears_take_the_compiled_step(folder, quant):
    """int8 (Q8_0) and NF4 held as block linears compile like a GGUF's (their block plan built by the child): the
    compiled step's tokens are the eager forward's."""
    from test_exact import engine_greedy

    from engine.config import SamplingConfig
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession
    from engine.model.fast_step import FastStep, machine_refusal
    from engine.model.loader import load_model

    if machine_refusal(torch.device("cpu")):
        pytest.skip(machine_refusal(torch.device("cpu")))
    lm = load_model(ModelSpec(source=str(folder), quantization=quant, device="cpu"))
    assert lm.model.kvscope_block_plan and lm.fast.model_refusal() == ""
    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]
    eager = engine_greedy(lm, prompt, 12, CacheConfig())
    lm.runner.fast = FastStep(lm, mode="on")
    lm.fast.start()
    assert lm.fast.wait(600) and lm.fast.state == "on", lm.fast.reason
    s = ChatSession(lm, CacheConfig())
    s.start_ids(prompt, SamplingConfig(max_new_tokens=12, ignore_eos=True))
    assert "compiled" in {r.event.path for r in drive(s) if r.event is not None}
    assert s.generated_ids == eager


def test_the_nf4_bounds_are_bitsandbytes_own():
    from bitsandbytes.backends.default.ops import _get_4bit_quantize_bounds

    bounds, order = _get_4bit_quantize_bounds("nf4", torch.device("cpu"))
    assert torch.equal(order, torch.arange(16)) and torch.equal(nf4_quant._bounds("nf4"), bounds.float())
