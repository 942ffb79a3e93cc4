"""The native product of the blocked linears (``engine.model.linear_kernel``): the plain product's values at one
row, at every group size (1-8 rows a block's weights are read for at once) and at many rows (groups of eight or six and
a rest), float32 and bfloat16 weights (by pairs of inputs where the CPU can), with and without a bias, at widths
that are and are not multiples of its vectors; the operator a compiled step calls; what it leaves to torch; and a
batched decode of chats on blocked weights going through it with HF's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.core import scheduler as batch
from engine.core.session import ChatSession
from engine.model import linear_kernel
from engine.model.loader import load_model
from engine.model.packed_linear import PackedLinear, block, unblock

pytestmark = pytest.mark.skipif(linear_kernel.LINEAR.library() is None,
                                reason=f"no native kernels here: {linear_kernel.LINEAR.why()}")
GROUP = 8  # rows the kernel reads a block's weights for at once (KVS_GROUP in engine/native/csrc/blocked_linear.c)


@pytest.fixture(autouse=True)
def one_thread():
    """As a model of these sizes runs here (``engine.model.threads``); the kernel is left alone on more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [*range(1, GROUP + 2), 13, 16, 130])
@pytest.mark.parametrize("out,n_in", [(16, 7), (96, 80), (960, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_gives_the_plain_product(rows, out, n_in, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out + n_in)
    w, x = torch.randn(out, n_in, generator=g), torch.randn(rows, n_in, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    assert linear_kernel.usable(x, block(w))
    got = linear_kernel.product(x, block(w), b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    assert got.shape == (rows, out)
    assert (got.double() - want).abs().max().item() <= 2e-6 * n_in ** 0.5 * 8  # float32 sums of n_in terms


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 13, 130])
@pytest.mark.parametrize("out,n_in", [(16, 7), (960, 576), (48, 33)])
def test_bfloat16_weights_give_the_float32_sum_of_their_products(rows, out, n_in):
    """bfloat16 weights and rows: the products are exact in float32 and summed there, then rounded once to
    bfloat16 — within one bfloat16 rounding of the exact sum (13 rows: eight, then five; an odd width's last input
    outside the pairs)."""
    g = torch.Generator().manual_seed(rows + out)
    w = torch.randn(out, n_in, generator=g).bfloat16()
    x = torch.randn(rows, n_in, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16()
    got = linear_kernel.blocked_product(x, block(w), b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-5 * n_in ** 0.5).all()


def test_the_portable_build_gives_the_same_without_pairs():
    """Built for any CPU of this architecture (no AVX512_BF16: bfloat16 widened in registers), the product gives
    what this CPU's build gives: float32 to summation order, bfloat16 within one rounding."""
    lib = linear_kernel.LINEAR.load(())
    assert not lib.kvs_bf16_pairs()
    g = torch.Generator().manual_seed(3)
    for dt, fn in ((torch.float32, lib.kvs_blocked_mm), (torch.bfloat16, lib.kvs_blocked_mm_h)):
        w, b = torch.randn(48, 33, generator=g).to(dt), torch.randn(48, generator=g).to(dt)
        for rows in (1, 5, 21):
            x = torch.randn(rows, 33, generator=g).to(dt)
            y = torch.empty(rows, 48, dtype=dt)
            wb = block(w)
            assert fn(rows, 33, 0, 3, x.data_ptr(), wb.data_ptr(), b.data_ptr(), y.data_ptr(), 48) == 0
            want = linear_kernel.product(x, wb, b).double()
            assert ((y.double() - want).abs() <= want.abs() * (2 ** -7 if dt == torch.bfloat16 else 1e-6) + 1e-5).all()


def test_the_operator_a_compiled_step_calls_gives_the_same_and_traces(monkeypatch):
    """``kvscope::blocked_linear``: eager it is ``blocked_product``; traced it stays one call whose output shape
    the graph knows without running it."""
    w, x = torch.randn(96, 80), torch.randn(5, 80)
    got = torch.ops.kvscope.blocked_linear(x, block(w), None)
    assert torch.equal(got, linear_kernel.blocked_product(x, block(w), None))
    ep = torch.export.export(_Op(block(w)), (x,), strict=False)
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"] == [torch.ops.kvscope.blocked_linear.default]
    assert torch.allclose(ep.module()(x), x @ w.T, atol=1e-5)


def test_the_operators_cpp_kernel_gives_what_the_python_one_gives():
    """``engine.model.linear_op`` registers a C++ CPU kernel for the operator (a compiled step's calls then skip
    Python): bit for bit the Python kernel's values, float32 and bfloat16, one to seventy rows, with a bias."""
    from engine.model import linear_op

    if not linear_op.attach():
        pytest.skip(f"no C++ kernel here: {linear_op.why()}")
    for dt in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(1)
        wb, b = block(torch.randn(48, 40, generator=g).to(dt)), torch.randn(48, generator=g).to(dt)
        for rows in (1, 8, 13, 70):
            x = torch.randn(rows, 40, generator=g).to(dt)
            assert torch.equal(torch.ops.kvscope.blocked_linear(x, wb, b), linear_kernel.blocked_product(x, wb, b))


def test_on_several_threads_the_cpp_kernel_shares_the_blocks_bit_for_bit():
    """Once ``linear_op`` is loaded, a product on several torch threads splits its blocks among them (``PARALLEL``):
    each block is summed as on one thread, so the values are the same bit for bit, float32 and bfloat16, one row
    and many; float32 on several threads is then native too."""
    from engine.model import linear_op

    if not linear_op.attach():
        pytest.skip(f"no C++ kernel here: {linear_op.why()}")
    assert linear_kernel.PARALLEL
    g = torch.Generator().manual_seed(2)
    for dt in (torch.float32, torch.bfloat16):
        wb, b = block(torch.randn(960, 576, generator=g).to(dt)), torch.randn(960, generator=g).to(dt)
        for rows in (1, 4, 70):
            x = torch.randn(rows, 576, generator=g).to(dt)
            one = linear_kernel.product(x, wb, b)
            torch.set_num_threads(2)
            try:
                assert linear_kernel.usable(x, wb)
                assert torch.equal(linear_kernel.product(x, wb, b), one)
            finally:
                torch.set_num_threads(1)


class _Op(torch.nn.Module):
    def __init__(self, wb):
        super().__init__()
        self.wb = torch.nn.Parameter(wb, requires_grad=False)

    def forward(self, x):
        return torch.ops.kvscope.blocked_linear(x, self.wb, None)


def test_what_it_leaves_to_torch(monkeypatch):
    wb = block(torch.randn(32, 8))
    assert linear_kernel.usable(torch.randn(200, 8), wb)  # any number of rows, one call
    assert not linear_kernel.usable(torch.randn(0, 8), wb)
    assert not linear_kernel.usable(torch.randn(4, 8, dtype=torch.float16), wb.half())
    assert not linear_kernel.usable(torch.randn(4, 8, dtype=torch.bfloat16), wb)  # mixed dtypes
    torch.set_num_threads(2)
    monkeypatch.setattr(linear_kernel, "PARALLEL", False)  # the C++ kernel not loaded (yet)
    assert not linear_kernel.usable(torch.randn(4, 8), wb)  # MKL shares the blocks among its threads
    assert linear_kernel.usable(torch.randn(4, 8, dtype=torch.bfloat16), wb.bfloat16())  # torch's bf16: 5 GB/s
    torch.set_num_threads(1)
    monkeypatch.setenv("KVSCOPE_NATIVE", "off")
    assert not linear_kernel.usable(torch.randn(4, 8), wb)
    lin = PackedLinear(wb, None, (32,), "blocked", 8)  # and the torch path gives the same
    x = torch.randn(4, 8)
    assert torch.allclose(lin(x), x @ unblock(wb).T, atol=1e-5)


def test_batched_chats_on_blocked_weights_run_through_it_with_hf_tokens(stories, stories_path, monkeypatch):
    """stories260K with every linear packed (q/k/v, o and down blocked): three chats decoded together."""
    monkeypatch.setenv("KVSCOPE_PREPACK", "on")
    lm = load_model(ModelSpec(source=str(stories_path)))
    monkeypatch.delenv("KVSCOPE_PREPACK")
    calls = []
    real = linear_kernel.product
    monkeypatch.setattr(linear_kernel, "product", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    tok = stories.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("Once upon a time", "Lily saw a big red ball", "Tim ran")]
    sessions = [ChatSession(lm, CacheConfig(mode="paged", page_size=16)) for _ in prompts]
    for s, ids in zip(sessions, prompts):
        s.start_ids(ids, SamplingConfig(max_new_tokens=40, ignore_eos=True))
    while live := [s for s in sessions if s.generating]:
        batch.step_all(live)
    # every round of the three (39 after the prefills) through it: 5 layers x (q/k/v merged, o, down)
    assert calls.count(3) >= 39 * 5 * 3
    for s, ids in zip(sessions, prompts):
        x = torch.tensor([ids])
        with torch.inference_mode():
            want = stories.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, min_new_tokens=40,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert s.generated_ids == want
        s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layout_is_made_by_the_library_as_torch_makes_it(dtype, monkeypatch):
    """A merged group's members (q/k/v: 2 x 64 + 32 rows, a width off the library's 64 columns) blocked side by side
    by the library, large enough for a mapping of its own, equal the concatenation blocked by torch's copy."""
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(rows, 1100, generator=g).to(dtype) for rows in (512, 512, 256)]
    ref = torch.cat(parts).reshape(-1, 16, 1100).transpose(1, 2).contiguous()  # [out/16, in, 16]
    got = block(parts)
    assert got.shape == ref.shape and torch.equal(got, ref)
    assert torch.equal(unblock(got), torch.cat(parts))
    monkeypatch.setattr(linear_kernel, "block_into", lambda w, out: False)  # no library: torch's copy
    assert torch.equal(block(parts), ref)
