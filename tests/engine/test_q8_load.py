"""``--quantize int8`` on a CPU: Q8_0 blocks quantized as each weight is read (``engine.model.q8_load``, the C
quantizer in engine/quant/csrc/kq_quantize.c) and multiplied by the GGUF block kernels. The blocks are bit for bit
the ``gguf`` package's Q8_0 (llama.cpp's reference code); the loaded model's weights are what the fit verdict said;
the paged cache's greedy tokens are HF ``generate``'s on the same quantized model. ``--quantize nf4``'s blocks, quantized
by the same library's C (``engine.model.nf4_quant``), are bitsandbytes' own bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, ModelSpec
from engine.model import fit, q8_load
from engine.model.loader import load_model

pytestmark = pytest.mark.skipif(not q8_load.available("cpu"), reason="no GGUF block kernels on this machine")


def test_blocks_are_llama_cpps_bit_for_bit():
    import gguf

    g = torch.Generator().manual_seed(0)
    ties = torch.arange(-64, 64, dtype=torch.float32).reshape(4, 32) + 0.5  # exact halves after scaling
    ties[:, 0] = 127.0
    for w in (torch.randn(257, 4096, generator=g) * 0.02, torch.randn(3, 32, generator=g) * 7, ties,
              torch.zeros(2, 64)):
        for x in (w, w.to(torch.bfloat16)):
            want = gguf.quants.quantize(x.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            np.testing.assert_array_equal(q8_load.quantize(x).numpy(), want)
    strided = torch.randn(64, 96, generator=g)[:, :64]  # rows taken from a wider tensor
    np.testing.assert_array_equal(q8_load.quantize(strided).numpy(), q8_load.quantize(strided.contiguous()).numpy())
    with pytest.raises(ValueError, match="no whole blocks of 32"):
        q8_load.quantize(torch.ones(4, 48))


@pytest.fixture(scope="module")
def folder(tmp_path_factory, stories_path):
    from test_fit import _folder  # tests/engine is on sys.path

    return _folder(tmp_path_factory.mktemp("q8") / "llama-bf16", stories_path)


def test_int8_holds_q8_0_blocks_and_decodes_as_hf_does(folder):
    from test_exact import engine_greedy, hf_greedy

    spec = ModelSpec(source=str(folder), quantization="int8", device="cpu")
    verdict = fit.estimate_path(folder, spec, "cpu")
    lm = load_model(spec)
    kinds = [type(m).__name__ for m in lm.model.modules()]
    assert kinds.count("BlockLinear") == 2 * 7 and "Linear8bitLt" not in kinds  # every layer linear; not lm_head
    assert type(lm.model.lm_head).__name__ == "Linear"  # the output head stays in floats, as bitsandbytes keeps it
    assert lm.info.weights_bytes == verdict.weights.bytes
    assert (lm.info.weights_format, lm.info.weights_held) == ("Q8_0", "quantized")
    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]
    assert engine_greedy(lm, prompt, 12, CacheConfig()) == hf_greedy(lm, prompt, 12)


def test_bitsandbytes_int8_on_request(folder, monkeypatch):
    monkeypatch.setenv(q8_load.ENV, "bitsandbytes")
    assert not q8_load.available("cpu")
    lm = load_model(ModelSpec(source=str(folder), quantization="int8", device="cpu"))
    assert "Linear8bitLt" in {type(m).__name__ for m in lm.model.modules()}
    assert lm.info.weights_format == "int8"


def test_nf4_blocks_are_bitsandbytes_bit_for_bit():
    """``--quantize nf4`` on a CPU: bitsandbytes' own 4-bit quantization computed by C (``engine.model.nf4_quant``)
    gives its torch code's codes and scales exactly, partial last blocks and odd counts included."""
    pytest.importorskip("bitsandbytes")
    from engine.model import nf4_quant

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(512, 256, generator=g) * 0.02, torch.randn(13, 7, generator=g), torch.zeros(2, 64),
             torch.randn(5, 100, generator=g).to(torch.bfloat16), torch.randn(3, 64, generator=g) * 1e-30,
             (torch.randn(64, 256, generator=g) * 0.02).to(torch.bfloat16)]  # whole blocks of bf16: widened in C
    want = [nf4_quant._default(c, 64, "nf4", torch.uint8) for c in cases]  # bitsandbytes' torch code
    assert nf4_quant.install()
    for c, (codes, scales) in zip(cases, want):
        got = torch.ops.bitsandbytes.quantize_4bit(c, 64, "nf4", torch.uint8)  # now the C kernel
        assert torch.equal(got[0], codes) and torch.equal(got[1], scales)
    fp4 = torch.ops.bitsandbytes.quantize_4bit(cases[1], 64, "fp4", torch.uint8)  # not ours: bitsandbytes' code
    assert torch.equal(fp4[0], nf4_quant._default(cases[1], 64, "fp4", torch.uint8)[0])


@pytest.mark.parametrize("nested", [False, True])
def test_nf4_cpu_layout_is_bitsandbytes_own(nested):
    """The layout bitsandbytes' AVX512-BF16 kernel reads, made at load by C (``nf4_quant.cpu_layout``), is the one
    its ``_convert_weight_packed_for_cpu`` makes at a first forward: the same bytes, scales and state, and the same
    outputs; a layer its kernel refuses (out % 32) is left to it."""
    bnb = pytest.importorskip("bitsandbytes")
    import copy

    from bitsandbytes.functional import _convert_weight_packed_for_cpu
    from bitsandbytes.nn import Linear4bit

    from engine.model import nf4_quant

    if not bnb.__version__.startswith(nf4_quant.LAYOUT_VERSIONS):
        pytest.skip(f"bitsandbytes {bnb.__version__}: its own conversion runs")
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(*[Linear4bit(n_in, n_out, bias=False, compress_statistics=nested, quant_type="nf4")
                                  for n_in, n_out in ((256, 96), (128, 256), (64, 40))])
    for m in model:
        m.weight.data = (torch.randn(m.out_features, m.in_features, generator=g) * 0.05)
    model = model.to("cpu").eval()  # quantized as it moves (bitsandbytes' Params4bit)
    for m in model:
        m.support_avx512bf16_for_cpu = m.out_features % 32 == 0 and m.in_features % 64 == 0  # as the loader sets
    theirs = copy.deepcopy(model)
    for m in theirs:
        if m.support_avx512bf16_for_cpu:
            m.weight.data, m.weight.quant_state = _convert_weight_packed_for_cpu(m.weight.data, m.weight.quant_state)
    assert nf4_quant.cpu_layout(model) == 2
    for ours, ref in zip(model, theirs):
        a, b = ours.weight.quant_state, ref.weight.quant_state
        assert torch.equal(ours.weight.data, ref.weight.data)
        assert torch.equal(a.absmax, b.absmax) and a.absmax.dtype == b.absmax.dtype
        for key in ("dtype", "nested", "original_dtype", "original_nested", "original_qshape", "packing_format_for_cpu"):
            assert getattr(a, key, None) == getattr(b, key, None), key
    x = torch.randn(3, 256, generator=g)
    with torch.no_grad():
        assert torch.equal(model[0](x), theirs[0](x))
