"""The fused decode attention over quantized pages (tq, int4, int8; ``engine.kv.quantized.tq_attend`` and its C kernel):
the same attention as reading the pages back and running SDPA, for every layout it reads, in both builds (this
CPU's and the portable one); greedy chats give the same tokens with it and without; where it does not apply, or
cannot be built, the torch path runs."""

from __future__ import annotations

import logging
import os
import subprocess
import time

import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession
from engine.kv.quantized import native, tq_attend
from engine.kv.quantized.schemes import scheme_for
from engine.native import build as native_build
from engine.native.libraries import ATTEND
from engine.model.shapes import build_shape

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native kernels here: {native.why()}")
KINDS = ("tq4", "tq3", "tq2", "int4", "int8")  # int8 keys: per channel at head_dim 8 (pages of 16), per token above
QJL = ("tq4-qjl", "tq3-qjl", "tq2-qjl")


def _role(kind, role, heads, rows, tail, d, g):
    """Random vectors quantized as ``kind`` (rows in pages of 16) → the kernel's RolePages (as the store builds them),
    and the same K/V as the attention would otherwise read them (``[H, rows + tail, W]``, rotated for tq kinds; QJL
    keys: W = 2 D)."""
    scheme = scheme_for(kind, role, d, 16)
    q = scheme.quantize(torch.randn(heads, max(rows // 16, 1), 16, d, generator=g), 0)[:, :rows // 16]  # [H, pages, 16, .]
    exact = torch.randn(heads, tail, d, generator=g)  # the page being filled
    pages, _ = scheme.fused_role(q, exact, 0)
    if scheme.rotated:
        held = torch.empty(heads, rows, scheme.width)
        if rows:
            scheme.read_rotated_into(q, held, 0)
        return pages, torch.cat([held, scheme.rotate(exact, 0)], 1)
    return pages, torch.cat([scheme.dequantize(q, torch.float32).reshape(heads, rows, d), exact], 1)


@pytest.mark.parametrize("build", ["this CPU", "portable"])
@pytest.mark.parametrize("d", [8, 16, 64, 128])
@pytest.mark.parametrize("k_kind,v_kind", [(k, v) for k in KINDS + QJL for v in KINDS])
def test_the_kernel_gives_sdpas_attention(build, d, k_kind, v_kind):
    lib = native.library() if build == "this CPU" else native.TQ.load(())
    g = torch.Generator().manual_seed(d)
    for heads, rep, rows, tail in ((2, 3, 48, 5), (1, 1, 32, 0), (3, 2, 0, 7)):
        kp, k = _role(k_kind, "k", heads, rows, tail, d, g)
        vp, v = _role(v_kind, "v", heads, rows, tail, d, g)
        q = torch.randn(heads * rep, k.shape[-1], generator=g)  # queries in the keys' read basis
        got = tq_attend.run(lib, q * d ** -0.5, kp, vp)  # [Hq, D]
        want = torch.nn.functional.scaled_dot_product_attention(q[None, :, None], k[None], v[None], enable_gqa=True,
                                                                scale=d ** -0.5)
        assert torch.allclose(got, want[0, :, 0], atol=2e-6, rtol=1e-5), (heads, rep, rows, tail)


def _greedy(lm, k, v, prompt, n=40):
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16, k_dtype=k, v_dtype=v))
    s.start_ids(prompt, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "max_tokens"
    s.close()
    return list(s.generated_ids)


@pytest.fixture(scope="module")
def hd64():
    return build_shape("tiny-llama-hd64")


@pytest.mark.parametrize("k,v", [("tq4", "tq4"), ("tq3", "tq2"), ("tq2", "tq4"), ("tq3-qjl", "tq3"), ("int4", "int4"),
                                 ("int4", "tq3"), ("int8", "int8"), ("int8", "tq4")])
def test_greedy_chats_are_the_same_with_the_kernel_and_without(hd64, monkeypatch, k, v):
    """head_dim 64, GQA 3 query heads a KV head, 72 prompt tokens (4 pages and a partial one) and 40 new ones."""
    prompt = torch.randint(3, 320, (72,), generator=torch.Generator().manual_seed(7)).tolist()
    calls = []
    run = tq_attend.run
    monkeypatch.setattr(tq_attend, "run", lambda *a: calls.append(1) or run(*a))
    fused = _greedy(hd64, k, v, prompt)
    assert len(calls) == 39 * 2  # every decode step after the first token, both layers
    monkeypatch.setenv("KVSCOPE_NATIVE", "off")
    assert native.library() is None and native.why() == "KVSCOPE_NATIVE=off"
    assert _greedy(hd64, k, v, prompt) == fused
    assert len(calls) == 78


def test_a_mask_that_hides_tokens_or_more_queries_take_the_torch_path():
    g = torch.Generator().manual_seed(3)
    kp, _ = _role("tq4", "k", 2, 32, 3, 64, g)
    vp, _ = _role("tq4", "v", 2, 32, 3, 64, g)
    key = tq_attend.placeholder(2, 35, 64, torch.float32, "cpu")
    fused = tq_attend.FusedPages(kp, vp, key, lambda: None)
    q = torch.randn(1, 4, 1, 64, generator=g)
    assert tq_attend.attend(fused, q, key, None, {}) is not None
    assert tq_attend.attend(fused, q, key, torch.ones(1, 1, 1, 35, dtype=torch.bool), {}) is not None
    hides = torch.ones(1, 1, 1, 35, dtype=torch.bool)
    hides[..., 0] = False
    assert tq_attend.attend(fused, q, key, hides, {}) is None
    assert tq_attend.attend(fused, torch.randn(1, 4, 2, 64), key, None, {}) is None  # two queries: a prefill
    assert tq_attend.attend(fused, q, key.clone(), None, {}) is None  # the model changed what the cache returned
    assert tq_attend.attend(fused, q, key, None, {"softcap": 30.0}) is None


def test_no_compiler_leaves_the_torch_path_and_says_why_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "TQ", native_build.Native(ATTEND, native.TQ.declare))
    with caplog.at_level(logging.INFO, logger=native_build.__name__):
        assert native.library() is None and native.library() is None
    assert native.why() == "false failed: exit status 1"
    assert [r.getMessage() for r in caplog.records] == [
        f"the fused decode attention: off (false failed: exit status 1); {ATTEND.cost}"]
    assert not list(tmp_path.rglob("*.so"))


def test_a_cached_library_that_does_not_load_is_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cc = native_build.compiler(cxx=False)
    target = native_build.cached_path(ATTEND, cc, ())
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not a shared library")  # cut short, or copied in from elsewhere
    lib = native.TQ.load(())
    g = torch.Generator().manual_seed(5)
    kp, k = _role("tq4", "k", 1, 16, 2, 64, g)
    vp, v = _role("int4", "v", 1, 16, 2, 64, g)
    q = torch.randn(2, 64, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q[None, :, None], k[None], v[None], enable_gqa=True)
    assert torch.allclose(tq_attend.run(lib, q * 64 ** -0.5, kp, vp), want[0, :, 0], atol=2e-6)
    assert target.read_bytes()[:4] == b"\x7fELF" or target.stat().st_size > 1000
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no build folder left behind


@pytest.mark.skipif(os.name != "posix", reason="an ASCII locale")
def test_the_kernels_build_under_an_ascii_locale(tmp_path):
    """The sources' comments hold UTF-8 (arrows, dashes): read or written in the locale's encoding they raised
    UnicodeEncodeError under LC_ALL=C without Python's UTF-8 mode, a traceback instead of the kernels."""
    import subprocess
    import sys

    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "XDG_CACHE_HOME": str(tmp_path)}
    code = ("import locale; from engine.kv.quantized import native; from engine.model import linear_kernel; "
            "print(locale.getpreferredencoding(), native.library() is not None, "
            "linear_kernel.LINEAR.library() is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ANSI_X3.4-1968", "True", "True"], out.stdout + out.stderr[-500:]


@pytest.mark.skipif(os.name != "posix", reason="process groups")
def test_a_compiler_past_its_time_is_stopped_with_what_it_started(tmp_path):
    """``cc`` compiles in child processes (``cc1``): a timed-out build must not leave them running (seen: a dozen
    orphaned ``cc1`` slowing the machine for minutes)."""
    marker = tmp_path / "still-running"
    with pytest.raises(subprocess.TimeoutExpired):
        native_build.compile_run(["sh", "-c", f"(sleep 2; touch {marker}) & sleep 30"], 0.5)
    time.sleep(2.5)
    assert not marker.exists()


@pytest.mark.skipif(native.library() is None, reason="no C compiler")
def test_several_threads_share_the_heads_and_give_the_one_thread_answer_bit_for_bit(monkeypatch):
    """The C++ library (``engine.model.linear_op``) shares a layer's KV heads among torch's threads; each head is
    computed as on one thread, so the answer is the same to the bit."""
    from engine.model import linear_op

    if not linear_op.attach():
        pytest.skip(f"no C++ kernels here: {linear_op.why()}")
    assert native.PARALLEL_TQ is not None
    g = torch.Generator().manual_seed(5)
    kp, _ = _role("tq3", "k", 4, 1024, 5, 64, g)
    vp, _ = _role("tq4", "v", 4, 1024, 5, 64, g)
    q = torch.randn(4 * 3, 64, generator=g) * 0.125  # 4 KV heads of 3 query heads, 1,029 tokens: a share each
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        par = tq_attend.run(native.library(), q, kp, vp)
        monkeypatch.setattr(native, "PARALLEL_TQ", None)
        one = tq_attend.run(native.library(), q, kp, vp)
    finally:
        torch.set_num_threads(threads)
    assert par is not None and torch.equal(par, one)
