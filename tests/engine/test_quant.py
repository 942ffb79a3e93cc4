"""engine.kv.quantized.quant: round-trip bounds, layouts, bytes per token, batched == per page."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.quantized import quant as Q

F16, F32 = torch.float16, torch.float32
EPS = 2.0**-20  # float32 arithmetic slack, relative to |x| and the scale
F16_TINY = 2.0**-24  # float16 subnormal quantum


def _gen(seed: int, shape, scale: float = 1.0, style: str = "randn") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    if style == "outlier":  # a few large key channels, as in real models (KIVI)
        x[..., :: max(1, shape[-1] // 3)] *= 20
    elif style == "offset":  # all-positive, far from zero
        x = x.abs() + 5 * scale
    elif style == "zeros":
        x = torch.zeros(shape)
    elif style == "const":
        x = torch.full(shape, 0.3 * scale)
    return x


def _check_int8(x: torch.Tensor, q: Q.QInt8) -> None:
    xf = x.float()
    s = q.scale.float()  # [..., T, 1]
    amax = xf.abs().amax(dim=-1, keepdim=True)
    assert (s * 127 >= amax * (1 - 1e-6)).all(), "scale clips the row"
    if q.scale.dtype == F16:
        assert (s <= amax / 127 * (1 + 2.0**-10) + F16_TINY).all(), "scale larger than fp16 round-up"
    else:
        assert (s <= amax / 127 * (1 + 1e-6)).all()
    err = (xf - Q.dequantize_int8(q, F32)).abs()
    assert (err <= s / 2 + EPS * (xf.abs() + s)).all(), f"int8 error {err.max()} over scale/2"


def _check_asym(x: torch.Tensor, q: Q.QInt4 | Q.QInt8Keys) -> None:
    """Asymmetric pages: int4 (codes 0..15) and per-channel int8 keys (codes 0..255)."""
    xf = x.float()
    d = x.shape[-1]
    top = 255 if isinstance(q, Q.QInt8Keys) else 15
    if q.role == "k":
        lo, hi = xf.amin(dim=-2, keepdim=True), xf.amax(dim=-2, keepdim=True)  # [..., 1, D]
        s, z = q.scale.float(), q.zero.float()  # [..., 1, D]
        s_el, z_el = s, z
    else:
        g = q.group
        n = math.ceil(d / g)
        pad = torch.cat([xf, xf[..., -1:].expand(*xf.shape[:-1], n * g - d)], dim=-1)
        grouped = pad.reshape(*xf.shape[:-1], n, g)  # [..., T, G, g]
        lo, hi = grouped.amin(-1), grouped.amax(-1)  # [..., T, G]
        s, z = q.scale.float(), q.zero.float()  # [..., T, G]
        s_el = s.repeat_interleave(g, dim=-1)[..., :d]
        z_el = z.repeat_interleave(g, dim=-1)[..., :d]
    assert (z <= lo).all() and (z + top * s >= hi - 1e-6 * (hi.abs() + z.abs())).all(), "range not covered"
    if q.scale.dtype == F16:
        ulp_lo = lo.abs() * 2.0**-10 + F16_TINY
        assert (s <= (hi - lo + ulp_lo) / top * (1 + 2.0**-10) + F16_TINY).all(), "scale beyond (max-min)/top + fp16"
    else:
        assert (s <= (hi - lo) / top * (1 + 1e-6) + 1e-30).all()
    err = (xf - Q.dequantize(q, F32)).abs()
    assert (err <= s_el / 2 + EPS * (xf.abs() + z_el.abs() + s_el)).all(), f"{q.kind} error {err.max()} over scale/2"


def _check(x: torch.Tensor, q: Q.QuantizedPage) -> None:
    assert tuple(q.shape) == tuple(x.shape)
    if isinstance(q, Q.QInt8):
        _check_int8(x, q)
    else:
        _check_asym(x, q)


def _same(a: Q.QuantizedPage, b: Q.QuantizedPage) -> bool:
    fields = ("codes", "scale") + (("zero",) if isinstance(a, (Q.QInt4, Q.QInt8Keys)) else ())
    return type(a) is type(b) and all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)


CASES = [("int8", "k"), ("int8", "v"), ("int4", "k"), ("int4", "v")]


# ------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind,role", CASES)
@pytest.mark.parametrize("head_dim", [1, 7, 8, 48, 64, 128])
@pytest.mark.parametrize("tokens", [1, 3, 16, 33])
@pytest.mark.parametrize("scale_dtype", [F16, F32])
def test_round_trip_bound_per_page(kind, role, head_dim, tokens, scale_dtype):
    for i, style in enumerate(("randn", "outlier", "offset")):
        x = _gen(head_dim * 1000 + tokens * 10 + i, (2, tokens, head_dim), scale=3.0, style=style)
        q = Q.quantize(kind, x, role, scale_dtype=scale_dtype)
        _check(x, q)


@pytest.mark.parametrize("kind,role", CASES)
def test_long_page_256_tokens(kind, role):
    x = _gen(7, (2, 256, 64), style="outlier")
    _check(x, Q.quantize(kind, x, role))


@pytest.mark.parametrize("kind,role", CASES)
@pytest.mark.parametrize("dtype", [F16, torch.bfloat16, F32])
def test_zero_page_gives_zeros_without_nan(kind, role, dtype):
    x = torch.zeros(2, 16, 8, dtype=dtype)
    q = Q.quantize(kind, x, role)
    assert (q.scale == 0).all()
    y = Q.dequantize(q, dtype)
    assert y.dtype == dtype and torch.equal(y, x)


@pytest.mark.parametrize("kind,role", CASES)
@pytest.mark.parametrize("value", [0.3, -2.5, 1e-4, 1000.0])
def test_constant_page(kind, role, value):
    x = torch.full((2, 16, 8), value)
    q = Q.quantize(kind, x, role)
    _check(x, q)
    assert torch.allclose(Q.dequantize(q), x, rtol=1e-3, atol=1e-7)  # 1e-4: float16-subnormal int8 scale


def test_int8_row_with_one_zero_row():
    x = torch.randn(2, 4, 8)
    x[1, 2] = 0
    q = Q.quantize_int8(x)
    assert q.scale[1, 2, 0] == 0 and (q.scale[0] > 0).all()
    assert torch.equal(Q.dequantize_int8(q)[1, 2], torch.zeros(8))
    _check(x, q)


def test_int8_exact_codes():
    x = torch.tensor([[[127.0, -63.5, 0.0, 1.0]]])  # [1, 1, 4]; absmax 127 → scale 1
    q = Q.quantize_int8(x)
    assert q.scale.item() == 1.0
    assert q.codes.tolist() == [[[127, -64, 0, 1]]]  # -63.5 rounds half to even
    assert q.codes.dtype == torch.int8 and q.scale.dtype == F16


def test_int8_symmetric_sign():
    x = _gen(3, (2, 5, 64))
    assert torch.equal(Q.quantize_int8(-x).codes, -Q.quantize_int8(x).codes)


def test_int4_keys_codes_and_packing_layout():
    t = torch.arange(16, dtype=F32)
    x = torch.stack([t, 15 - t, torch.zeros(16)], dim=-1)[None]  # [1, 16, 3]: ch0 ramp up, ch1 down, ch2 zero
    q = Q.quantize_int4_keys(x)
    assert q.codes.shape == (1, 16, 2) and q.codes.dtype == torch.uint8
    assert q.scale.shape == (1, 1, 3) and q.zero.shape == (1, 1, 3)
    assert q.scale[0, 0].tolist() == [1.0, 1.0, 0.0] and q.zero[0, 0].tolist() == [0.0, 0.0, 0.0]
    # byte 0 = ch0 (low nibble) | ch1 << 4; byte 1 = ch2 | pad(0) << 4
    assert q.codes[0, :, 0].tolist() == [i | (15 - i) << 4 for i in range(16)]
    assert q.codes[0, :, 1].tolist() == [0] * 16
    assert torch.equal(Q.dequantize_int4_keys(q), x)


def test_int4_values_groups_and_padding():
    # D = 40, group 32: groups [0:32] and [32:40] (padded internally to 64); two scales per token
    x = _gen(11, (3, 5, 40), style="outlier")
    q = Q.quantize_int4_values(x, group=32)
    assert q.codes.shape == (3, 5, 20) and q.scale.shape == (3, 5, 2) and q.group == 32
    second = x[..., 32:]
    assert torch.equal(q.zero[..., 1], Q._round_down(second.amin(-1), F16))
    assert Q.dequantize(q, F32).is_contiguous()
    _check(x, q)


@pytest.mark.parametrize("head_dim,group,expect_group,expect_groups", [(8, 32, 8, 1), (7, 32, 7, 1), (64, 32, 32, 2), (128, 32, 32, 4), (128, 64, 64, 2), (50, 16, 16, 4)])
def test_int4_value_group_clipped_to_head_dim(head_dim, group, expect_group, expect_groups):
    x = _gen(head_dim, (2, 4, head_dim))
    q = Q.quantize_int4_values(x, group=group)
    assert (q.group, q.scale.shape[-1]) == (expect_group, expect_groups)
    _check(x, q)


def test_int4_keys_are_per_channel_values_per_token():
    x = _gen(5, (2, 16, 8))
    x[:, :, 3] *= 100  # outlier channel: only key channel 3 and value rows get a bigger scale
    k, v = Q.quantize_int4_keys(x), Q.quantize_int4_values(x)
    assert (k.scale[..., 3] > 10 * k.scale[..., 2]).all()
    assert torch.equal(k.scale[..., :3], Q.quantize_int4_keys(x[..., :3]).scale)
    assert v.scale.shape == (2, 16, 1)


def test_fp16_saturation_no_nan_and_fp32_scales_keep_bound():
    x = _gen(2, (2, 16, 8), scale=2e6)  # range beyond float16 scales/zeros
    for kind, role in CASES:
        y = Q.dequantize(Q.quantize(kind, x, role))
        assert torch.isfinite(y).all()
        _check(x, Q.quantize(kind, x, role, scale_dtype=F32))


@pytest.mark.parametrize("kind,role", CASES)
def test_input_dtypes_and_output_dtypes(kind, role):
    base = _gen(9, (2, 16, 64))
    for in_dtype in (F16, torch.bfloat16, F32):
        x = base.to(in_dtype)
        q = Q.quantize(kind, x, role)
        _check(x, q)
        ref = Q.dequantize(q, F32)
        for out in (F16, torch.bfloat16, F32):
            y = Q.dequantize(q, out)
            assert y.dtype == out and y.shape == x.shape and y.is_contiguous()
            assert torch.equal(y, ref.to(out)), "output dtype must be one rounding of the float32 result"


# ----------------------------------------------------------------------------------------------- batched


@pytest.mark.parametrize("kind,role", CASES)
@pytest.mark.parametrize("head_dim", [7, 8, 64])
def test_batched_equals_per_page_exactly(kind, role, head_dim):
    n, h, p = 5, 3, 16
    pages = _gen(head_dim, (n, h, p, head_dim), style="outlier")  # [N, H, P, D]
    batched = Q.quantize(kind, pages, role)
    singles = [Q.quantize(kind, pages[i], role) for i in range(n)]
    assert _same(batched, Q.stack(singles))
    for i in range(n):
        assert _same(batched[i], singles[i])
    y = Q.dequantize(batched, F16)  # [N, H, P, D] in one call
    for i in range(n):
        assert torch.equal(y[i], Q.dequantize(singles[i], F16))


@pytest.mark.parametrize("kind,role", CASES)
def test_layer_layout_heads_by_slots(kind, role):
    # the cache's layer layout [H, num_slots, D], page p in slots [p*P, (p+1)*P), viewed as [H, N, P, D]
    h, n, p, d = 2, 4, 8, 16
    layer = _gen(1, (h, n * p, d), style="outlier")
    q = Q.quantize(kind, layer.view(h, n, p, d), role)  # leading dims [H, N]
    for page in range(n):
        single = Q.quantize(kind, layer[:, page * p : (page + 1) * p], role)  # [H, P, D]
        assert _same(q[:, page], single)
    assert torch.equal(Q.dequantize(q).reshape(h, n * p, d), Q.dequantize(q).view(h, n * p, d))


@pytest.mark.parametrize("kind,role", CASES)
def test_allocate_put_and_gather(kind, role):
    num_pages, h, p, d = 6, 2, 16, 8
    store = Q.allocate(kind, role, (num_pages, h), p, d)
    assert torch.equal(Q.dequantize(store), torch.zeros(num_pages, h, p, d))
    nbytes_before = store.nbytes
    pages = _gen(4, (3, h, p, d))
    ids = torch.tensor([4, 1, 2])
    store.put(ids, Q.quantize(kind, pages, role))
    assert store.nbytes == nbytes_before
    got = Q.dequantize(store[ids])  # gather three pages, one dequantize
    assert torch.equal(got, Q.dequantize(Q.quantize(kind, pages, role)))
    assert torch.equal(Q.dequantize(store[0]), torch.zeros(h, p, d))
    store.put(5, Q.quantize(kind, pages[0], role))
    assert torch.equal(Q.dequantize(store[5]), got[0])


def test_empty_batch():
    x = torch.zeros(0, 2, 16, 8)
    for kind, role in CASES:
        q = Q.quantize(kind, x, role)
        assert q.nbytes == 0 and Q.dequantize(q).shape == x.shape


# ---------------------------------------------------------------------------------------- bytes per token


@pytest.mark.parametrize("kind,role", CASES)
@pytest.mark.parametrize("head_dim", [1, 7, 8, 40, 64, 128])
@pytest.mark.parametrize("tokens", [1, 16, 17, 64])
@pytest.mark.parametrize("scale_dtype", [F16, F32])
def test_nbytes_per_token_equals_formula(kind, role, head_dim, tokens, scale_dtype):
    heads = 3
    q = Q.quantize(kind, torch.randn(heads, tokens, head_dim), role, scale_dtype=scale_dtype)
    assert q.nbytes / tokens == Q.bytes_per_token(kind, role, heads, head_dim, tokens, scale_dtype)


@pytest.mark.parametrize(
    "kind,role,head_dim,expected",
    [  # bytes per token per kv head at page 16, float16 scales (formula in the module docstring)
        ("int8", "k", 64, 66),
        ("int8", "v", 128, 130),
        ("int4", "k", 64, 32 + 2 * 64 * 2 / 16),  # 48
        ("int4", "v", 64, 32 + 2 * 2 * 2),  # 40
        ("int4", "k", 128, 64 + 2 * 128 * 2 / 16),  # 96
        ("int4", "v", 128, 64 + 2 * 4 * 2),  # 80
        ("int4", "k", 7, 4 + 2 * 7 * 2 / 16),
        ("int4", "v", 7, 4 + 2 * 1 * 2),
    ],
)
def test_bytes_per_token_figures(kind, role, head_dim, expected):
    assert Q.bytes_per_token(kind, role, 1, head_dim, 16) == expected


def test_int8_ratio_target_vs_fp16():
    for d in (64, 128):
        ratio = Q.bytes_per_token("int8", "k", 4, d, 16) / (4 * d * 2)
        assert ratio <= 0.53
    assert Q.bytes_per_token("int8", "k", 1, 64, 16, F32) / (64 * 2) == 68 / 128  # fp32 scales: 0.531


@pytest.mark.parametrize("head_dim,page_size,layout", [(8, 16, "channel"), (8, 15, "token"), (64, 16, "token"),
                                                        (64, 128, "channel"), (128, 128, "token"), (1, 2, "channel")])
def test_int8_key_layout_is_per_channel_only_when_no_dearer(head_dim, page_size, layout):
    assert Q.int8_key_layout(head_dim, page_size) == layout
    q = Q.quantize("int8", torch.randn(2, page_size, head_dim), "k")
    assert isinstance(q, Q.QInt8Keys if layout == "channel" else Q.QInt8)
    assert isinstance(Q.allocate("int8", "k", (2, 3), page_size, head_dim), type(q))
    per_token = Q.bytes_per_token("int8", "v", 1, head_dim, page_size)  # values are always per token
    assert Q.bytes_per_token("int8", "k", 1, head_dim, page_size) <= per_token
    assert isinstance(Q.quantize("int8", torch.randn(2, page_size, head_dim), "v"), Q.QInt8)


def test_int8_keys_per_channel_beat_per_token_on_outlier_channels():
    """Keys with a few large channels and channel offsets (as in stories260K): per-channel codes spend their
    range on each channel's own spread, so the error is far lower at the same bytes."""
    x = _gen(11, (4, 16, 8)) * torch.tensor([1.0, 1, 1, 20, 1, 1, 1, 20]) + torch.tensor([3.0, -1, 0, 0, 2, 0, 0, -4])
    ch, tok = Q.quantize("int8", x, "k"), Q.quantize_int8(x)
    assert isinstance(ch, Q.QInt8Keys) and ch.nbytes == tok.nbytes
    small = [0, 1, 2, 4, 5, 6]  # per token, these share a scale with the two outliers
    err_ch = (Q.dequantize(ch) - x)[..., small].abs().max()
    err_tok = (Q.dequantize(tok) - x)[..., small].abs().max()
    assert err_ch < 0.25 * err_tok
    assert Q.error_stats(x, ch).rel_rms < Q.error_stats(x, tok).rel_rms
    assert ch.codes.dtype == torch.uint8 and ch.scale.shape == (4, 1, 8) and ch.zero.shape == (4, 1, 8)


def test_int4_key_overhead_shrinks_with_page_size():
    per_page = [Q.bytes_per_token("int4", "k", 1, 128, p) for p in (16, 32, 64, 128, 256)]
    assert per_page == sorted(per_page, reverse=True)
    assert per_page[-1] == 64 + 2


# ---------------------------------------------------------------------------------------------- errors


def test_invalid_arguments_raise_value_error():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError):
        Q.quantize("int2", x, "k")
    with pytest.raises(ValueError):
        Q.quantize("int8", x, "q")
    with pytest.raises(ValueError):
        Q.quantize("int8", x.to(torch.int32), "k")
    with pytest.raises(ValueError):
        Q.quantize("int8", torch.randn(2, 0, 8), "k")
    with pytest.raises(ValueError):
        Q.quantize("int8", x, "k", scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        Q.quantize("int4", x, "v", group=0)
    with pytest.raises(ValueError):
        Q.dequantize_int4_keys(Q.quantize("int4", x, "v"))
    with pytest.raises(ValueError):
        Q.dequantize_int4_values(Q.quantize("int4", x, "k"))
    with pytest.raises(ValueError):
        Q.dequantize_int8(Q.quantize("int4", x, "k"))
    with pytest.raises(ValueError):
        Q.quantize("int8", x, "k")[..., 0]
    with pytest.raises(ValueError):
        Q.quantize("int8", x, "k")[0, 1]  # would index the token dim of a [H, T, D] page
    with pytest.raises(ValueError):
        Q.stack([Q.quantize("int8", x, "k"), Q.quantize("int4", x, "k")])
    with pytest.raises(ValueError):
        Q.allocate("int4", "k", (2,), 16, 8).put(0, Q.quantize("int4", x[0], "v"))


def test_string_scale_dtype_and_error_stats():
    x = _gen(8, (2, 16, 64))
    q = Q.quantize("int8", x, "v", scale_dtype="float32")
    assert q.scale.dtype == F32
    stats = Q.error_stats(x, q)
    assert 0 < stats.max_abs <= q.scale.max().item() / 2 * (1 + 1e-5)
    assert 0 < stats.rel_rms < 0.02 and stats.mse > 0
    assert Q.error_stats(torch.zeros(1, 2, 8), Q.quantize("int4", torch.zeros(1, 2, 8), "k")).rel_rms == 0.0
    worse = Q.error_stats(x, Q.quantize("int4", x, "v"))
    assert worse.rel_rms > stats.rel_rms


# ----------------------------------------------------------------------------------------------- property


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind_role=st.sampled_from(CASES),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    tokens=st.integers(1, 40),
    head_dim=st.integers(1, 72),
    group=st.integers(1, 64),
    log_scale=st.floats(-6, 2.5),  # keeps |x| inside float16 scale limits (saturation has its own test)
    style=st.sampled_from(["randn", "outlier", "offset", "zeros", "const"]),
    scale_dtype=st.sampled_from([F16, F32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_shapes(kind_role, lead, tokens, head_dim, group, log_scale, style, scale_dtype, seed):
    kind, role = kind_role
    shape = (*lead, tokens, head_dim)
    x = _gen(seed, shape, scale=10.0**log_scale, style=style)
    q = Q.quantize(kind, x, role, scale_dtype=scale_dtype, group=group)
    _check(x, q)
    n_pages = max(1, math.prod(lead))
    assert q.nbytes / (n_pages * tokens) == Q.bytes_per_token(kind, role, 1, head_dim, tokens, scale_dtype, group)
    if lead:  # batched == per page along the first leading dim
        for i in range(lead[0]):
            assert _same(q[i], Q.quantize(kind, x[i], role, scale_dtype=scale_dtype, group=group))
