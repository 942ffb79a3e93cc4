"""The GGUF block kernels (``engine.quant``): every type's blocks against the ``gguf`` package's dequantize (the
float reference), both roads of the product, one and several rows and threads, bad shapes refused before a byte
is read.

Random block bytes are valid blocks (every bit pattern decodes); only the half-precision scales are set, so the
values are finite and of a model's size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from engine.quant import formats, kernel  # noqa: E402

T = gguf.GGMLQuantizationType
QUANT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT = ("F32", "F16", "BF16")
# where each type keeps its half-precision scale(s) in a block: (offset, count)
SCALES = {"Q4_0": (0, 1), "Q5_0": (0, 1), "Q8_0": (0, 1), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208, 1)}

pytestmark = pytest.mark.skipif(kernel.library() is None, reason="no C compiler for the GGUF block kernels")


def blocks(name: str, rows: int, n: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of ``name``: random bytes with finite, small scales (or random floats)."""
    rng = np.random.default_rng(seed)
    if name in FLOAT:
        x = rng.standard_normal((rows, n)).astype(np.float32)
        if name == "F16":
            return x.astype(np.float16).view(np.uint8)
        if name == "BF16":
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return x.view(np.uint8)
    kind = T[name]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, n // block, size), dtype=np.uint8)
    at, count = SCALES[name]
    for k in range(count):
        d = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[:, :, at + 2 * k:at + 2 * k + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, T[name]), dtype=np.float64)


@pytest.mark.parametrize("name", QUANT + FLOAT)
def test_dequantize_equals_the_gguf_package(name):
    raw = blocks(name, 5, 512)
    got = kernel.dequantize(torch.from_numpy(raw), T[name].value, 512).numpy()
    assert np.array_equal(got, gguf.quants.dequantize(raw, T[name]))
    ids = torch.tensor([[4, 0], [2, 2]])
    rows = kernel.get_rows(torch.from_numpy(raw), T[name].value, 512, ids)
    assert rows.shape == (2, 2, 512) and torch.equal(rows[0, 0], torch.from_numpy(got[4]))


@pytest.mark.parametrize("name", QUANT + FLOAT)
@pytest.mark.parametrize("m", [1, 3, 6, 37])
def test_float_road_is_the_dequantized_product(name, m):
    n, out = 768 if name not in ("Q4_K", "Q5_K", "Q6_K") else 512, 20
    raw = blocks(name, out, n, seed=m)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(out)
    y = kernel.matmul(x, torch.from_numpy(raw), T[name].value, n, bias=bias, road="float").numpy()
    ref = x.double().numpy() @ reference(raw, name).T + bias.double().numpy()
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("m", [1, 3, 37])
def test_bf16_rows_take_bfloat16_activations_on_the_default_road(m):
    """BF16 weights, default road: activations rounded to bfloat16 (as llama.cpp rounds them for its bf16
    products), sums in float32 — a decode row (vdpbf16ps a row, 530 = 16 pairs short of a whole vector: the tail
    masked) as a prompt's sixteen and more (the GEMM); without AVX512_BF16, float32 activations."""
    n, out = 530, 19
    raw = blocks("BF16", out, n)
    w = torch.from_numpy(raw)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(2))
    y = kernel.matmul(x, w, T.BF16.value, n).numpy()
    wd = reference(raw, "BF16")
    pairs = kernel.library().kq_gemm_float_pairs(T.BF16.value, 0)  # AVX512_BF16 here
    xr = x.to(torch.bfloat16).double().numpy() if pairs else x.double().numpy()
    ref = xr @ wd.T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    if m < 16:  # a row's sums do not depend on the rows beside it
        one = np.stack([kernel.matmul(x[i:i + 1], w, T.BF16.value, n).numpy()[0] for i in range(m)])
        assert np.array_equal(one, y)


def ggml_q8(x: np.ndarray, kind: int) -> np.ndarray:
    """x [m, n] as the integer road's activations, dequantized (float64): ggml's Q8_0 blocks (kind 0, the gguf
    package's own quantizer: d = max|x| / 127 in half precision) or its Q8_K (kind 1: quantize_row_q8_K_ref in
    numpy, scaled by the value of largest magnitude, sign kept, d a float)."""
    if kind == 0:
        q8 = gguf.quants.quantize(x.astype(np.float32), T.Q8_0).reshape(x.shape[0], -1, 34)
        d = q8[:, :, :2].copy().view(np.float16).astype(np.float64)  # [m, n / 32, 1]
        return (q8[:, :, 2:].view(np.int8) * d).reshape(x.shape)
    b = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    mx = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    iscale = np.float32(-127.0) / mx
    q = np.minimum(127, np.rint(iscale * b))
    return (q * (1 / iscale).astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("blocks_odd", [False, True])
@pytest.mark.parametrize("m", [7, 37])
def test_int8_road_is_exact_on_the_quantized_activations(name, blocks_odd, m):
    """7 rows: the row products (four, then three); 37: the GEMM's tiles of sixteen, the last one padded."""
    if blocks_odd and name.endswith("_K"):
        pytest.skip("a k-quant row is whole blocks of 256")
    n, out = 544 if blocks_odd else 512, 21  # 17 blocks: an odd last one; 21 outputs: a pass of 8 and a tail
    raw = blocks(name, out, n, seed=3)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    w = torch.from_numpy(raw)
    y = kernel.matmul(x, w, T[name].value, n, road="int8").numpy()
    ref = ggml_q8(x.numpy(), 1 if name.endswith("_K") else 0) @ reference(raw, name).T
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max()
    one = np.stack([kernel.matmul(x[i:i + 1], w, T[name].value, n, road="int8").numpy()[0] for i in range(m)])
    if m < 16:
        assert np.array_equal(one, y)  # a row's sums do not depend on the rows beside it
    else:  # the GEMM sums in another order than a row alone: float rounding apart, the same
        assert np.abs(one - y).max() <= 2e-6 * np.abs(ref).max()


PACKED = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


def packed_or_skip(w: torch.Tensor, name: str, n: int) -> torch.Tensor:
    p = kernel.pack(w, T[name].value, n)
    if p is None:
        pytest.skip("no packed product in this build (AVX-512 VNNI)")
    return p


@pytest.mark.parametrize("name", PACKED)
def test_packed_rows_read_back_as_the_file_stores_them(name):
    """Sixteen rows a group, the last group short (21 rows: 16 + 5, padded with zero rows); an odd last block of
    the 32-block types (17 blocks: half a step of two)."""
    n = 512 if name.endswith("_K") else 544
    raw = blocks(name, 21, n, seed=7)
    p = packed_or_skip(torch.from_numpy(raw), name, n)
    assert p.numel() == kernel.library().kq_pack_bytes(T[name].value, 21, n) and p.data_ptr() % 64 == 0
    row = torch.empty(raw.shape[1], dtype=torch.uint8)
    for o in range(21):  # the library's inverse of the packing (no product reads a packed row back)
        assert kernel.library().kq_unpack_row(T[name].value, p.data_ptr(), 21, n, o, row.data_ptr()) == 0
        assert np.array_equal(row.numpy(), raw[o])


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("m", [1, 7, 37])
def test_packed_product_is_exact_on_the_quantized_activations(name, m):
    """The packed product: ggml's integer sums on the same 8-bit activations as the row products (within float
    rounding of each), and every row summed alike whatever rows are beside it (one row alone = the same row of
    37: bit for bit)."""
    n = 512 if name.endswith("_K") else 544
    raw = blocks(name, 21, n, seed=8)
    w = torch.from_numpy(raw)
    p = packed_or_skip(w, name, n)
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(8))
    bias = torch.randn(21)
    y = kernel.matmul(x, w, T[name].value, n, bias=bias, road="int8", packed=p).numpy()
    ref = ggml_q8(x.numpy(), 1 if name.endswith("_K") else 0) @ reference(raw, name).T + bias.double().numpy()
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max()
    rows = kernel.matmul(x, w, T[name].value, n, bias=bias, road="int8").numpy()  # the file's layout
    assert np.abs(rows - y).max() <= 2e-6 * np.abs(ref).max()
    one = np.stack([kernel.matmul(x[i:i + 1], w, T[name].value, n, bias=bias, packed=p).numpy()[0]
                    for i in range(m)])
    assert np.array_equal(one, y)


# the bytes of a block that hold its quants (and Q4_K's / Q6_K's sub-block scales), by type: (block bytes, spans)
EXTREME = {"Q4_0": (18, ((2, 18, 0xFF),)), "Q8_0": (34, ((2, 34, 0x80),)),
           "Q4_K": (144, ((4, 144, 0xFF),)), "Q6_K": (210, ((0, 192, 0xFF), (192, 208, 0x80)))}


@pytest.mark.parametrize("name", PACKED)
def test_packed_product_holds_the_largest_sums(name):
    """Every quant and scale at its largest magnitude (4-bit 15, Q6_K's 63 with scales -128, Q8_0's -128) against
    activations all at +-127: the kernels' sums of products kept in 16 bits (AVX2: maddubs pairs added before one
    madd) stay in range and equal ggml's integer sums."""
    n = 512 if name.endswith("_K") else 544
    raw = blocks(name, 21, n, seed=5)
    size, spans = EXTREME[name]
    flat = raw.reshape(-1, size)  # [blocks, block bytes]
    for a, b, v in spans:
        flat[:, a:b] = v
    w = torch.from_numpy(raw)
    p = packed_or_skip(w, name, n)
    x = torch.ones(4, n)
    x[1] = -1
    x[2, ::2] = -1
    x[3, :n // 2] = -3  # the other half quantized to -+42
    y = kernel.matmul(x, w, T[name].value, n, road="int8", packed=p).numpy()
    ref = ggml_q8(x.numpy(), 1 if name.endswith("_K") else 0) @ reference(raw, name).T
    assert np.abs(ref).max() > 0 and np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max()


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The kernels built for the installers' AVX2 level (x86-64-v3: no AVX-512), loaded beside this build's."""
    import ctypes

    from engine.native import build
    from engine.native.libraries import KQ

    flags, need = next((f, need) for name, f, need in build.LEVELS if name == "avx2")
    cc = build.compiler(False)
    if cc is None or not all(f in build.cpu_flags() for f in need):
        pytest.skip("no C compiler, or this CPU does not run AVX2")
    out = tmp_path_factory.mktemp("kq-avx2") / "kq-avx2.so"
    build.compile_library(KQ, cc, flags, out)
    return kernel._declare(ctypes.CDLL(str(out)))


@pytest.mark.slow  # builds the library for the AVX2 level (~10-30 s here)
@pytest.mark.parametrize("name", PACKED)
def test_the_avx2_build_packs_and_sums_as_avx512_does(avx2_build, name):
    """An AVX2-only machine multiplies Q4_0, Q8_0, Q4_K and Q6_K repacked (maddubs for vpdpbusd, with ggml's sign
    trick for Q8_0's signed bytes: the same integer sums, the same result bit for bit as the AVX-512 build's)."""
    lib, t, n, rows = avx2_build, T[name].value, 512 if name.endswith("_K") else 544, 21
    assert lib.kq_isa_name() == b"AVX2"
    nbytes = lib.kq_pack_bytes(t, rows, n)
    assert nbytes > 0
    raw = blocks(name, rows, n, seed=11)
    w = torch.from_numpy(raw)
    p = torch.empty(nbytes, dtype=torch.uint8)
    assert lib.kq_pack(t, w.data_ptr(), w.stride(0), rows, n, p.data_ptr(), 1) == 0
    x = torch.randn(7, n, generator=torch.Generator().manual_seed(11))
    y = torch.empty(7, rows)
    assert lib.kq_packed_matmul(t, p.data_ptr(), rows, n, x.data_ptr(), 7, n, y.data_ptr(), rows, None, None, 1) == 0
    ref = ggml_q8(x.numpy(), 1 if name.endswith("_K") else 0) @ reference(raw, name).T
    assert np.abs(y.numpy() - ref).max() <= 2e-6 * np.abs(ref).max()
    here = kernel.pack(w, t, n)
    if here is not None and kernel.isa() == "AVX-512 + VNNI":
        assert torch.equal(kernel.matmul(x, w, t, n, road="int8", packed=here), y)


def test_packed_product_takes_the_row_order_and_threads():
    n, out = 256, 40
    w = torch.from_numpy(blocks("Q4_K", out, n, seed=9))
    p = packed_or_skip(w, "Q4_K", n)
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(9))
    perm = torch.randperm(out, generator=torch.Generator().manual_seed(9)).to(torch.int32)
    plain = kernel.matmul(x, w, T.Q4_K.value, n, packed=p, threads=1)
    moved = kernel.matmul(x, w, T.Q4_K.value, n, out_map=perm, packed=p, threads=2)
    assert torch.equal(moved[:, perm.long()], plain)
    with pytest.raises(ValueError, match="packed"):
        kernel.matmul(x, w[:32], T.Q4_K.value, n, packed=p)  # another weight's packing refused, never read


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_packed_groups_shared_among_threads_are_each_done_once(name):
    """The packed product shares its sixteen-row groups among the threads: any number of threads (more than the
    cores too, more than divide the groups evenly) writes every output once, the same bits, a ragged last group
    included; fewer activation rows than threads (a decode step's one) or more, the same."""
    n, out = 256, 16 * 37 + 8
    w = torch.from_numpy(blocks(name, out, n, seed=11))
    p = packed_or_skip(w, name, n)
    for m in (1, 2, 6):
        x = torch.randn(m, n, generator=torch.Generator().manual_seed(11 + m))
        rows = kernel.matmul(x, w, T[name].value, n, road="int8", threads=1)  # the rows' layout: no packed copy read
        one = kernel.matmul(x, w, T[name].value, n, packed=p, threads=1)
        assert torch.allclose(one, rows, rtol=0, atol=2e-6 * rows.abs().max().item())
        for threads in (2, 3, 7):
            assert torch.equal(kernel.matmul(x, w, T[name].value, n, packed=p, threads=threads), one), (m, threads)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "BF16"])
def test_threads_share_rows_and_change_nothing(name):
    n, out = 512, 37
    w = torch.from_numpy(blocks(name, out, n, seed=5))
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(5))
    one = kernel.matmul(x, w, T[name].value, n, threads=1)
    two = kernel.matmul(x, w, T[name].value, n, threads=2)
    assert torch.equal(one, two)


def test_out_map_writes_each_row_where_asked():
    n, out = 256, 8
    w = torch.from_numpy(blocks("Q4_K", out, n))
    x = torch.randn(2, n)
    perm = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4], dtype=torch.int32)
    plain = kernel.matmul(x, w, T.Q4_K.value, n)
    moved = kernel.matmul(x, w, T.Q4_K.value, n, out_map=perm)
    assert torch.equal(moved[:, perm.long()], plain)


def test_bad_shapes_are_refused_before_reading():
    w = torch.from_numpy(blocks("Q4_K", 4, 512))
    with pytest.raises(ValueError, match="Q4_K weight: expected uint8"):
        kernel.matmul(torch.randn(1, 512), w[:, :200], T.Q4_K.value, 512)  # rows cut short: never read past
    with pytest.raises(ValueError, match="multiples of 256 elements, not 500"):
        kernel.matmul(torch.randn(1, 500), w, T.Q4_K.value, 500)  # 500 is no whole number of blocks
    with pytest.raises(IndexError, match="outside"):
        kernel.get_rows(w, T.Q4_K.value, 512, torch.tensor([4]))
    with pytest.raises(ValueError, match="activations"):
        kernel.matmul(torch.randn(1, 256), w, T.Q4_K.value, 512)


def test_formats_count_what_is_held():
    shape = (2048, 8192)
    assert formats.held_bytes(T.Q4_K.value, shape) == 2048 * 32 * 144
    assert formats.held_bytes(T.Q4_K.value, shape, kept=False) == 2048 * 8192 * 4
    assert formats.held_bytes(T.Q3_K.value, shape) == 2048 * 8192 * 4  # no kernel: dequantized
    assert formats.held_bytes(T.F32.value, (2048,)) == 2048 * 4
    mapped, copied = formats.model_bytes([(T.Q8_0.value, (64, 64)), (T.F32.value, (64,))])
    assert (mapped, copied) == (64 * 2 * 34, 256)
    assert "Q6_K" in formats.kept_names() and formats.name(99) == "type 99"


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_the_gpu_product_dequantizes_chunks_as_the_file_says(name):
    """The GPU's path without ggml's kernels (transformers' torch dequantizer, a chunk of rows at a time, then a
    matrix product), run on the CPU: the float road's result."""
    from engine.quant.modules import _cuda_product

    n, out = 512, 24
    w = torch.from_numpy(blocks(name, out, n, seed=4))
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(4))
    got = _cuda_product(x, w, T[name].value, n, out)
    want = kernel.matmul(x, w, T[name].value, n, road="float")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _mapping_rss_kb(path) -> int:
    """The process's resident KiB of its mappings of ``path`` (/proc/self/smaps)."""
    kb, mine = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")) and ":" not in head[0]:
            mine = head[-1] == str(path)
        elif mine and line.startswith("Rss:"):
            kb += int(head[1])
    return kb


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED") or not __import__("os").path.exists(
    "/proc/self/smaps"), reason="Linux: a mapping's resident pages are read from /proc")
def test_a_weight_packed_from_its_file_lets_its_pages_go_and_packs_the_same(tmp_path):
    """A weight multiplied from a GGUF mapping is packed ~16 MiB at a time and each chunk's file pages let go once
    packed (an 8B model's 431 MB output head is never held twice): the packed bytes are those of the same rows packed
    from memory, and the file's pages are not resident after."""
    import mmap

    n, rows = 4096, 16 * 300 + 5  # Q8_0: 4,352 bytes a row, ~21 MB: two chunks and a short last group
    raw = blocks("Q8_0", rows, n, seed=13)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 100 + raw.tobytes())  # not page-aligned, as a tensor in a GGUF
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    w = torch.frombuffer(m, dtype=torch.uint8, offset=100, count=raw.size).view(rows, -1)
    heap = packed_or_skip(torch.from_numpy(raw.copy()), "Q8_0", n)
    mapped = kernel.pack(w, T.Q8_0.value, n, mapped=True)
    assert torch.equal(mapped, heap)
    assert _mapping_rss_kb(path) <= 3 * 4  # at most the pages at the chunks' seams, none of the ~21 MB
    assert torch.equal(w[rows - 1], torch.from_numpy(raw[rows - 1]))  # read again from the file
