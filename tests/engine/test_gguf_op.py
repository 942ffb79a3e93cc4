"""The C++ kernel of ``kvscope::gguf_linear`` (``engine/native/csrc/gguf_ops.cpp``, its table filled by
``engine.quant.gguf_op``): once the Python kernel has answered a call with a plain descriptor's product, the C++ one
answers the same arguments with the same C function, bit for bit, without Python (a bf16 folder's blocked owner:
its bfloat16 product); whatever else (a packing still pending, a loader's shapes-only run, a module changed or
collected) goes to the Python kernel, which stays the answer.

Weights are random valid blocks (``test_gguf_kernels.blocks``); the Python kernel's calls are counted where it looks up
the weight's packed owner (its first step), so a test sees which kernel answered.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import weakref

import pytest
import torch

pytest.importorskip("gguf")

from test_gguf_kernels import T, blocks  # noqa: E402  (tests/engine is on sys.path)

from engine.model import linear_op  # noqa: E402
from engine.quant import gguf_op, kernel, modules  # noqa: E402
from engine.quant.modules import BlockLinear, shapes_only  # noqa: E402

pytestmark = pytest.mark.skipif(kernel.library() is None, reason="no C compiler for the GGUF block kernels")
OP, PY = torch.ops.kvscope.gguf_linear, torch.ops.kvscope.gguf_linear_py


@pytest.fixture
def cpp(monkeypatch):
    """The C++ kernel attached, an empty table, and a count of the Python kernel's calls (``calls[0]``)."""
    if not linear_op.attach():
        pytest.skip(f"no C++ operators here: {linear_op.why()}")
    gguf_op.forget()
    calls = [0]

    class Counted(weakref.WeakValueDictionary):
        def get(self, key, default=None):  # the Python kernel's first step: its weight's packed owner
            calls[0] += 1
            return super().get(key, default)
    monkeypatch.setattr(modules, "_PACKED", Counted())
    yield calls
    gguf_op.forget()


def _weight(name: str, out: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(blocks(name, out, n, seed))  # [out, row_bytes] uint8


def _args(name, out, n, bias, out_map, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(out, generator=g) if bias else None
    mp = torch.randperm(out, generator=g).to(torch.int32) if out_map else None
    return _weight(name, out, n, seed), b, mp


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "F16"])
@pytest.mark.parametrize("road", [0, 1])
@pytest.mark.parametrize("m", [1, 5])
def test_the_cpp_kernel_gives_the_python_kernels_product_bit_for_bit(cpp, name, road, m):
    """The rows' own product (no packed owner): the first call is Python's and fills the table; the next calls are
    C++'s, equal to the Python kernel's, with and without a bias and a row order, on one and two threads, the
    activations strided or not."""
    n, out = 512, 48
    for bias, out_map in ((False, False), (True, True)):
        w, b, mp = _args(name, out, n, bias, out_map, seed=m)
        x = torch.randn(m, n, generator=torch.Generator().manual_seed(road))
        first = OP(x, w, T[name].value, n, b, mp, road)
        before = cpp[0]
        got = OP(x, w, T[name].value, n, b, mp, road)
        assert cpp[0] == before, "the second call went to Python"
        want = PY(x, w, T[name].value, n, b, mp, road)
        assert torch.equal(got, want) and torch.equal(first, want)
        assert got.shape == (m, out) and got.abs().sum() > 0
        wide = torch.randn(n, m).t()  # [m, n], not contiguous
        assert torch.equal(OP(wide, w, T[name].value, n, b, mp, road), PY(wide, w, T[name].value, n, b, mp, road))
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(OP(x, w, T[name].value, n, b, mp, road), PY(x, w, T[name].value, n, b, mp, road))
        finally:
            torch.set_num_threads(threads)
    assert OP(x[:0], w, T[name].value, n, b, mp, road).shape == (0, out)


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_a_packed_owners_product_is_served_from_the_table(cpp, name):
    """A packed block linear (its weight the operator's constant): the C++ kernel serves its packed descriptor,
    the products equal the module's own forward and the Python kernel's."""
    n = 512
    w, b, _ = _args(name, 64, n, True, False)
    lin = BlockLinear(w, T[name].value, n, bias=b)
    if not lin.pack():
        pytest.skip(f"this build packs no {name}")
    x = torch.randn(3, n)
    OP(x, lin.weight, lin.ggml_type, n, lin.bias, None, 0)
    before = cpp[0]
    got = OP(x, lin.weight, lin.ggml_type, n, lin.bias, None, 0)
    assert cpp[0] == before and gguf_op.size() == 1
    assert torch.equal(got, lin(x)) and torch.equal(got, PY(x, lin.weight, lin.ggml_type, n, lin.bias, None, 0))


def test_a_pending_packing_is_done_by_python_even_after_its_rows_were_tabled(cpp):
    """A weight's rows multiplied (and tabled) before a loader defers its packing: the next call packs it (the table
    was emptied), and the packed product is then the one served."""
    n = 512
    w = _weight("Q4_K", 32, n)
    x = torch.randn(1, n)
    lin = BlockLinear(w, 12, n)
    OP(x, w, 12, n, None, None, 0)
    assert gguf_op.size() == 1
    packed_after = []
    if not lin.defer_pack(lambda: packed_after.append(True)):
        pytest.skip("this build packs no Q4_K")
    assert gguf_op.size() == 0
    before = cpp[0]
    got = OP(x, w, 12, n, None, None, 0)
    assert cpp[0] == before + 1 and packed_after == [True] and lin.packed is not None
    assert torch.equal(got, lin(x))
    OP(x, w, 12, n, None, None, 0)
    assert cpp[0] == before + 1 and gguf_op.size() == 1


def test_inside_shapes_only_every_call_is_pythons_and_nothing_is_tabled(cpp):
    """A loader's shapes-only run: the C++ kernel answers nothing from the table, a pending packing stays pending,
    nothing is offered; after it the same call is tabled."""
    n = 256
    w = _weight("Q8_0", 32, n)
    x = torch.randn(1, n)
    OP(x, w, 8, n, None, None, 0)
    lin = BlockLinear(_weight("Q4_0", 32, n, seed=1), 2, n)
    pending = lin.defer_pack(lambda: None)
    with shapes_only():
        before = cpp[0]
        assert torch.equal(OP(x, w, 8, n, None, None, 0), PY(x, w, 8, n, None, None, 0))
        OP(x, lin.weight, 2, n, None, None, 0)
        assert cpp[0] == before + 3 and gguf_op.size() == 0
        assert lin.pending() == pending
    OP(x, w, 8, n, None, None, 0)
    before = cpp[0]
    OP(x, w, 8, n, None, None, 0)
    assert cpp[0] == before and gguf_op.size() == 1


def test_a_bf16_blocked_owner_is_answered_in_cpp_up_to_16_rows(cpp):
    """A bf16 folder's weight held blocked (``packed_linear.BF16_BLOCKED``: bfloat16 compute): after Python's first
    call the C++ kernel answers it, bit for bit the module's product (the rows rounded to bfloat16, the blocked
    bfloat16 product, widened), on one thread and two; from 17 rows (where the layout's product may be oneDNN's)
    and with a bias every call stays Python's."""
    from engine.model import packed_linear

    n, out = 256, 32
    lin = BlockLinear(_weight("BF16", out, n), 30, n)
    lin.layout = packed_linear.BF16_BLOCKED
    if not lin.pack():
        pytest.skip("no blocked product here")
    threads, g = torch.get_num_threads(), torch.Generator().manual_seed(3)
    x = torch.randn(2, n, generator=g)
    first = cpp[0]
    try:
        for rows in (1, 2, 16):
            x = torch.randn(rows, n, generator=g)
            want = lin(x)
            assert want.dtype == torch.float32
            for th in (1, 2):
                torch.set_num_threads(th)
                assert torch.equal(OP(x, lin.weight, 30, n, None, None, 0), want)
    finally:
        torch.set_num_threads(threads)
    assert cpp[0] == first + 1 and gguf_op.size() == 1  # Python's first call only
    x = torch.randn(17, n, generator=g)
    before = cpp[0]
    assert torch.equal(OP(x, lin.weight, 30, n, None, None, 0), lin(x)) and cpp[0] == before + 1
    lin.bias = torch.nn.Parameter(torch.randn(out, generator=g).to(torch.bfloat16), requires_grad=False)
    assert gguf_op.size() == 0
    x = torch.randn(1, n, generator=g)
    before = cpp[0]
    ys = [OP(x, lin.weight, 30, n, lin.bias, None, 0) for _ in range(3)]
    assert cpp[0] == before + 3 and gguf_op.size() == 0
    assert all(torch.equal(y, lin(x)) for y in ys)


def test_a_collected_or_changed_module_empties_the_table(cpp):
    """An owner collected takes its entries with it (its storages let go); a module changed empties the table
    too, and the next call comes back to Python for the module's new state."""
    n = 512
    lin = BlockLinear(_weight("Q6_K", 32, n), 14, n)
    if not lin.pack():
        pytest.skip("this build packs no Q6_K")
    x = torch.randn(1, n)
    w = lin.weight
    OP(x, w, 14, n, None, None, 0)
    assert gguf_op.size() == 1
    del lin
    gc.collect()
    assert gguf_op.size() == 0
    other = BlockLinear(_weight("Q6_K", 32, n, seed=2), 14, n)
    OP(x, other.weight, 14, n, None, None, 0)
    assert gguf_op.size() == 1
    other.bias = torch.nn.Parameter(torch.ones(32), requires_grad=False)
    assert gguf_op.size() == 0
    before = cpp[0]
    got = OP(x, other.weight, 14, n, other.bias, None, 0)
    assert cpp[0] == before + 1 and torch.equal(got, other(x))


def test_a_descriptor_not_of_its_arguments_is_refused(cpp):
    """The table takes a descriptor only with the tensors it points into."""
    n = 256
    w, other = _weight("Q8_0", 16, n), _weight("Q8_0", 16, n, seed=3)
    desc = kernel.weight(w, 8, n, None, None, "int8")
    held = [torch.empty(0, dtype=torch.uint8).set_(other.untyped_storage())]
    entry = functools.partial(torch.ops.kvscope.gguf_table_put, w, 8, n, None, None, 0)
    with pytest.raises(RuntimeError, match="points outside"):
        entry(held, ctypes.addressof(desc))
    assert gguf_op.size() == 0


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "F16"])
def test_an_embedding_row_is_looked_up_in_cpp_once_bound(cpp, monkeypatch, name):
    """``kvscope::gguf_rows`` (a compiled step's token row): the Python kernel answers its first call and binds the
    lookup; from then the C++ kernel answers — the same rows bit for bit, any shape of ids — without Python; an id
    outside the table is one IndexError there too; ids that are not integers stay Python's."""
    rows, n = 40, 256
    w = _weight(name, rows, n, seed=3)
    ids = torch.tensor([[0, 39, 7], [7, 1, 2]])
    ROWS = torch.ops.kvscope.gguf_rows
    want = kernel.get_rows(w, T[name].value, n, ids)
    assert torch.equal(ROWS(w, T[name].value, n, ids), want)  # (the first: Python's, binding the lookup)
    asked = [0]
    real = kernel.get_rows
    monkeypatch.setattr(kernel, "get_rows", lambda *a: (asked.__setitem__(0, asked[0] + 1), real(*a))[1])
    got = ROWS(w, T[name].value, n, ids)
    assert asked[0] == 0 and got.shape == (2, 3, n) and torch.equal(got, want)
    assert torch.equal(ROWS(w, T[name].value, n, torch.tensor(39)), want[0, 1]) and asked[0] == 0
    assert ROWS(w, T[name].value, n, torch.tensor([], dtype=torch.int32)).shape == (0, n)
    for bad in (40, -1):
        with pytest.raises(IndexError, match="outside the table's 40 rows"):
            ROWS(w, T[name].value, n, torch.tensor([1, bad]))
    assert asked[0] == 0
    assert torch.equal(ROWS(w, T[name].value, n, torch.tensor([7.0])), want[1, :1]) and asked[0] == 1  # Python's
