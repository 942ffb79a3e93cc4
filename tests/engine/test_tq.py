"""Rotated low-bit K/V (tq4 / tq3 / tq2, QJL keys): bytes, the paper's error bound, the rotation, the QJL estimate,
the pages in a store read both ways, and chats on stories260K through the real session."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession
from engine.kv.paged import sizes
from engine.kv.quantized import codebook, native, rotation, tq_attend, turbo
from engine.kv.quantized.basis import Basis
from engine.kv.quantized.roles import KVShape
from engine.kv.quantized.schemes import scheme_for
from engine.kv.store.arena import PageArena
from engine.kv.store.storage import PagedKV
from engine.model import runner

TQ = ("tq4", "tq3", "tq2")
QJL = ("tq4-qjl", "tq3-qjl", "tq2-qjl")


def paper_bound(bits: int) -> float:
    """TurboQuant's upper bound on D_mse = E||x - x̂||² / ||x||² at ``bits`` bits a coordinate (its Theorem 1)."""
    return float(np.sqrt(3.0) * np.pi / 2.0 / 4.0 ** bits)


@pytest.mark.parametrize("kind,role", [(k, r) for k in TQ for r in "kv"] + [(k, "k") for k in QJL])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 96, 128])
def test_pages_hold_exactly_the_formula(kind, role, head_dim):
    """Bytes really held (codes + norms [+ QJL signs + residual norms]) = ``sizes.bytes_per_token``, exactly."""
    for page in (1, 16):
        scheme = scheme_for(kind, role, head_dim, page)
        q = scheme.quantize(torch.randn(3, 2, page, head_dim), layer=1)  # [H, N, P, D]
        per_token = sizes.bytes_per_token(kind, role, 3, head_dim, page)
        assert q.nbytes / (2 * page) == per_token == scheme.bytes_per_token(3)
    bits = sizes.tq_bits(kind)
    extra = 2 + (2 if kind in QJL else 0)  # float16 norm (+ the residual's)
    assert per_token == 3 * (head_dim * bits / 8 + extra)  # every head dim here is a multiple of 8


def test_bytes_against_bf16_at_head_dim_64():
    """The issue's targets (K and V together, pages of 16): tq4 ≤ 0.27, tq3 ≤ 0.21, tq2 ≤ 0.15 of bf16."""
    bf16 = 2 * 64 * 2
    ratio = {k: sum(sizes.bytes_per_token(k, r, 1, 64, 16) for r in "kv") / bf16 for k in TQ}
    assert ratio == {"tq4": 68 / 256, "tq3": 52 / 256, "tq2": 36 / 256}
    assert ratio["tq4"] <= 0.27 and ratio["tq3"] <= 0.21 and ratio["tq2"] <= 0.15
    int4 = sum(sizes.bytes_per_token("int4", r, 1, 64, 16) for r in "kv") / bf16
    assert int4 > 0.27  # 0.344 at pages of 16


@pytest.mark.parametrize("head_dim", [8, 64, 96, 128])
@pytest.mark.parametrize("kind", TQ)
def test_round_trip_error_within_the_papers_bound(kind, head_dim):
    """E||x - x̂||²/||x||² ≤ (√3π/2)/4^B (TurboQuant's Theorem 1), and equal to the codebook's own distortion:
    isotropic vectors are uniform on the sphere after any rotation, so the expectation is exact here."""
    bits = sizes.tq_bits(kind)
    scheme = scheme_for(kind, "v", head_dim, 16)
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(4, 64, 16, head_dim, generator=g) * torch.rand(4, 64, 16, 1, generator=g) * 30  # any norms
    err = ((scheme.dequantize(scheme.quantize(x, 3), torch.float32, 3) - x) ** 2).sum(-1) / (x ** 2).sum(-1)
    theory = head_dim * codebook.distortion(head_dim, bits)
    assert err.mean().item() <= paper_bound(bits)
    assert err.mean().item() == pytest.approx(theory, rel=0.06)


def test_the_rotation_makes_the_bound_hold_for_a_spiky_vector():
    """One fixed vector with an outlier channel (what keys look like), quantized under 200 seeds (layers): the
    rotation spreads the outlier, so the mean error meets the bound that holds for random rotations."""
    x = torch.full((64,), 0.05)
    x[3] = 25.0
    scheme = scheme_for("tq3", "k", 64, 1)
    errs = [((scheme.dequantize(scheme.quantize(x.view(1, 1, 64), layer), torch.float32, layer)[0, 0] - x) ** 2).sum()
            / (x ** 2).sum() for layer in range(200)]
    assert float(np.mean(errs)) <= paper_bound(3)


@pytest.mark.parametrize("head_dim", [8, 64, 80, 96, 128])
def test_rotations_are_orthogonal_and_seeded_per_layer_head_and_role(head_dim):
    r = rotation.stack(rotation.rotation, 3, head_dim, 5, "k", "cpu", torch.float64)  # [H, D, D]
    eye = torch.eye(head_dim, dtype=torch.float64)
    assert torch.allclose(r @ r.transpose(-1, -2), eye.expand(3, -1, -1), atol=1e-12)
    x, y = torch.randn(3, 40, head_dim, dtype=torch.float64), torch.randn(3, 40, head_dim, dtype=torch.float64)
    rx, ry = turbo.rotate(x, r), turbo.rotate(y, r)
    assert torch.allclose(rx.norm(dim=-1), x.norm(dim=-1), rtol=1e-12)  # norms kept
    assert torch.allclose((rx * ry).sum(-1), (x * y).sum(-1), atol=1e-10)  # inner products kept
    again = rotation.stack(rotation.rotation, 3, head_dim, 5, "k", "cpu", torch.float64)
    assert torch.equal(r, again)  # the same layer, head and role: the same matrix
    others = [rotation.rotation(head_dim, 6, 0, "k"), rotation.rotation(head_dim, 5, 0, "v")]
    assert all(not np.allclose(o, r[0].numpy()) for o in others) and not torch.allclose(r[0], r[1])
    if rotation.is_power_of_two(head_dim):  # Walsh–Hadamard with random signs, twice: the butterflies give R
        g = rotation.rng(5, 0, "k", rotation.ROTATION)
        s1, s2 = (torch.from_numpy(g.choice((-1.0, 1.0), size=head_dim)) for _ in range(2))
        assert torch.allclose(rotation.fwht(rotation.fwht(x[0] * s1) * s2), rx[0], atol=1e-12)
        hadamard = rotation.fwht(torch.eye(head_dim, dtype=torch.float64)) * head_dim ** 0.5
        assert torch.equal(hadamard.abs(), torch.ones_like(hadamard))  # a ±1 matrix: H Hᵀ = D I above


def test_qjl_keys_give_unbiased_inner_products():
    """⟨q, k̃⟩ over 600 seeded projections averages to ⟨q, k⟩ (tq2-qjl: 1-bit codes + 1-bit QJL); the 1-bit
    codes alone shrink it (by ~2/π: a bias the mean shows many standard errors away)."""
    g = torch.Generator().manual_seed(7)
    k, q = torch.randn(64, generator=g), torch.randn(64, generator=g)
    k = k + 0.8 * q  # a key the query attends to: ⟨q, k⟩ well away from 0
    true = float(q @ k)
    qjl, mse = scheme_for("tq2-qjl", "k", 64, 1), scheme_for("tq2-qjl", "k", 64, 1)
    c, th = (torch.from_numpy(f(64, 1)) for f in (codebook.centroids, codebook.thresholds))
    with_qjl, codes_only = [], []
    for layer in range(600):
        k_hat = qjl.dequantize(qjl.quantize(k.view(1, 1, 64), layer), torch.float32, layer)[0, 0]
        with_qjl.append(float(q @ k_hat))
        rot, _ = mse.matrices(layer, 1, "cpu")
        codes_only.append(float(q @ turbo.dequantize(turbo.quantize(k.view(1, 1, 64), rot, c, th, 1), rot, c)[0, 0]))
    for est, unbiased in ((with_qjl, True), (codes_only, False)):
        mean, se = float(np.mean(est)), float(np.std(est)) / math.sqrt(len(est))
        assert (abs(mean - true) < 4 * se) == unbiased, (mean, true, se)
    assert float(np.mean(codes_only)) / true == pytest.approx(2 / math.pi, rel=0.1)


@pytest.mark.parametrize("k_kind,v_kind", [("tq4", "tq4"), ("tq3-qjl", "tq2"), ("auto", "tq3"), ("tq2", "int4")])
def test_store_reads_rotated_pages_both_ways_alike(k_kind, v_kind):
    """Pages read back rotated, with the attention turning queries and output (``Basis``), give the attention of
    the pages read back turned: same output, the tail page exact, bytes as the formula."""
    H, D, P, L, n = 2, 64, 16, 2, 41
    arena = PageArena(KVShape(L, H, D, torch.float32, torch.device("cpu")), P, 4, k_kind=k_kind, v_kind=v_kind)
    store = PagedKV(arena)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
    store.reserve(n)
    for layer in range(L):
        store.update(layer, k, v)
    store.commit()
    k1, v1 = torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g)
    store.reserve(1)
    plain = [t.clone() for t in store.update(1, k1, v1)]  # [1, H, n+1, D] each, the original basis (buffers reused)
    rotated_k, rotated_v, basis = store.update_in_basis(1, k1, v1)
    assert isinstance(basis, Basis) and (basis.keys is None) == (k_kind == "auto")
    assert torch.equal(plain[0][0, :, 2 * P:], torch.cat([k[0, :, 2 * P:], k1[0]], 1))  # the tail: exact
    query = torch.randn(1, 2 * H, 1, D, generator=g)  # GQA: 2 query heads a KV head
    want = torch.nn.functional.scaled_dot_product_attention(query, plain[0], plain[1], enable_gqa=True)
    fused = basis.fused  # a decode step whose two roles the fused kernel reads: placeholders, the pages as codes
    assert (fused is not None) == (native.library() is not None and "auto" not in (k_kind, v_kind))
    if fused is not None:
        assert rotated_k is fused.key_placeholder and rotated_k.shape == (1, H, n + 1, D)
        out = tq_attend.attend(fused, basis.queries(query), rotated_k, None, {"scaling": D ** -0.5})
        assert torch.allclose(basis.outputs(out), want.transpose(1, 2), atol=1e-5)
        rotated_k, rotated_v = fused.materialize()
    got = torch.nn.functional.scaled_dot_product_attention(basis.queries(query), rotated_k, rotated_v,
                                                           enable_gqa=True, scale=D ** -0.5)
    assert torch.allclose(basis.outputs(got.transpose(1, 2)), want.transpose(1, 2), atol=1e-5)
    full = (n + 1) // P
    per = {r: 0 if kind == "auto" else sizes.bytes_per_token(kind, r, H, D, P)
           for r, kind in (("k", k_kind), ("v", v_kind))}
    want_bytes = sum(full * P * per[r] if per[r] else 3 * P * H * D * 4 for r in "kv") + \
        sum(P * H * D * 4 for r in "kv" if per[r])  # quantized full pages + each quantized role's full-precision tail
    store.commit()
    assert store.bytes_per_layer() == [want_bytes] * L


def test_reads_of_two_widths_in_turn_keep_the_buffer_size():
    """QJL keys read rotated are 2 D wide, read back turned D: a re-rotating policy reads both at every step. The
    one-layer buffer grew by doubling at each change of width (64 GB asked for after ~30 steps on stories260K)."""
    H, D, P, n = 2, 64, 1, 9
    arena = PageArena(KVShape(1, H, D, torch.float32, torch.device("cpu")), P, 16, k_kind="tq3-qjl", v_kind="auto")
    store = PagedKV(arena)
    store.reserve(n)
    store.update(0, torch.randn(1, H, n, D), torch.randn(1, H, n, D))
    store.commit()
    view, dp = store.views["k"], store._plan()
    for _ in range(60):  # 2^60 rows if it doubled each time
        assert view.read(0, n, dp).shape == (H, n, D)
        assert view.read_basis(0, n, dp)[0].shape == (H, n, 2 * D)


def _chat(lm, k, v, n=48):
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16, k_dtype=k, v_dtype=v))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=n, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    return s, r


@pytest.mark.parametrize("k,v", [("tq4", "tq4"), ("tq3", "tq3"), ("tq2", "tq2"), ("tq3-qjl", "tq3"), ("int4", "tq4")])
def test_chats_decode_and_show_the_bytes_the_formula_says(stories, monkeypatch, k, v):
    """A stories260K chat decodes with each precision through the real session; the snapshot (what the Memory
    panel and the status bar show) holds the formula's bytes; reading pages rotated changes no token."""
    s, r = _chat(stories, k, v)
    info, n = stories.info, s.cached_tokens
    full, fill = divmod(n, 16)
    fp_token = info.num_kv_heads * info.head_dim * 4  # float32
    want = info.num_layers * sum(full * 16 * sizes.bytes_per_token(kind, role, info.num_kv_heads, info.head_dim, 16)
                                 + (16 * fp_token if fill else 0) for role, kind in (("k", k), ("v", v)))
    assert r.snapshot.kv_bytes == want
    assert len(s.generated_ids) == 48 and r.stats.decode_tokens_per_s > 0
    ids = s.generated_ids
    s.close()
    monkeypatch.setattr(runner, "ROTATED_READS", False)
    s2, _ = _chat(stories, k, v)
    assert s2.generated_ids == ids
    s2.close()


def test_values_refuse_the_qjl_kinds_in_one_line():
    with pytest.raises(ValueError, match="'tq3-qjl' is for keys only"):
        CacheConfig(v_dtype="tq3-qjl")
    assert CacheConfig(k_dtype="tq3-qjl", v_dtype="tq3").k_dtype == "tq3-qjl"


def test_quality_has_a_row_for_every_precision():
    """``python -m engine quality`` scores every K/V precision, the rotated ones and QJL keys included."""
    from engine.config import KV_DTYPES
    from engine.tools.quality import default_settings

    settings = default_settings(511, 512)
    kinds = {s.k_dtype for s in settings} | {s.v_dtype for s in settings}
    assert set(KV_DTYPES) | {"tq3-qjl"} <= kinds
    assert all(any(s.k_dtype == s.v_dtype == k and s.policy == "none" for s in settings) for k in KV_DTYPES[1:])
