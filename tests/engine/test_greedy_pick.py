"""The greedy pick (engine/native/csrc/argmax.c through ``linear_kernel.argmax``): torch's ``argmax`` and ``max`` in
one pass, on this build and on the installers' AVX2 and portable levels; the sampler takes it only where nothing is
applied to the logits first."""

from __future__ import annotations

import ctypes
import math
import platform

import pytest
import torch

from engine.config import SamplingConfig
from engine.core.sampling import Sampler
from engine.errors import NonFiniteLogitsError
from engine.model import linear_kernel

SIZES = (1, 2, 15, 16, 17, 63, 64, 65, 127, 129, 512, 32064, 128256)


def _cases():
    g = torch.Generator().manual_seed(5)
    for n in SIZES:
        yield torch.randn(n, generator=g)
        yield torch.randint(-2, 3, (n,), generator=g).float()  # ties everywhere: the first of the largest
        yield torch.full((n,), -math.inf)
        x = torch.randn(n, generator=g)
        x[n // 2:] = math.inf  # +inf from the middle on: its first
        yield x
        z = torch.zeros(n)
        z[::2] = -0.0  # -0.0 equals 0.0: index 0
        yield z


def _pick(lib, x):
    top = ctypes.c_float()
    return lib.kvs_argmax(x.data_ptr(), x.shape[0], ctypes.byref(top)), top.value


def _assert_torch(lib):
    for x in _cases():
        i, top = _pick(lib, x)
        assert (i, top) == (int(torch.argmax(x)), float(x.max())), x.shape[0]
        if x.shape[0] > 2:
            y = x.clone()
            y[-2:] = math.nan  # in the tail after the whole sixteens
            if x.shape[0] > 100:
                y[1] = math.nan  # and inside them
            i, top = _pick(lib, y)
            assert i == int(torch.argmax(y)) and math.isnan(top)  # torch takes the first NaN as the largest
    assert _pick(lib, torch.zeros(1))[0] == 0
    assert lib.kvs_argmax(None, 0, None) == -1


def test_the_pick_is_torchs_argmax_and_max():
    lib = linear_kernel.LINEAR.library()
    if lib is None:
        pytest.skip("no native library here")
    _assert_torch(lib)
    assert linear_kernel.argmax(torch.tensor([1.0, 3.0, 3.0])) == (1, 3.0)
    assert linear_kernel.argmax(torch.tensor([1.0, 3.0], dtype=torch.bfloat16)) is None  # torch's, not this
    assert linear_kernel.argmax(torch.randn(4, 2)[:, 0]) is None  # not contiguous


@pytest.mark.slow  # builds the library twice (a few seconds each)
@pytest.mark.parametrize("level", ["avx2", "portable"])
def test_the_installers_levels_pick_alike(level, tmp_path):
    from engine.native import build
    from engine.native.libraries import LINEAR

    flags, need = next(((f, need) for name, f, need in build.LEVELS if name == "avx2")) if level == "avx2" \
        else (("-march=x86-64",), ())
    cc = build.compiler(False)
    if cc is None or not all(f in build.cpu_flags() for f in need) or "x86_64" not in platform.machine():
        pytest.skip("no C compiler, or not an x86-64 CPU that runs the level")
    out = tmp_path / f"linear-{level}.so"
    build.compile_library(LINEAR, cc, flags, out)
    _assert_torch(linear_kernel._declare(ctypes.CDLL(str(out))))


def test_a_plain_greedy_reply_never_asks_torchs_argmax(monkeypatch):
    if linear_kernel.LINEAR.library() is None:
        pytest.skip("no native library here")
    logits = torch.randn(128256, generator=torch.Generator().manual_seed(1))
    want = int(torch.argmax(logits))
    monkeypatch.setattr(torch, "argmax", lambda *a, **k: pytest.fail("torch's argmax was asked"))
    assert Sampler(SamplingConfig())(logits) == want


def test_what_changes_the_logits_first_still_decides():
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0])
    # the largest is a stop token before the reply's minimum: the next one
    assert Sampler(SamplingConfig(min_new_tokens=2), stop_ids=(1,))(logits) == 2
    s = Sampler(SamplingConfig(min_new_tokens=1), stop_ids=(1,))
    assert [s(logits), s(logits)] == [2, 1]  # its minimum reached: the stop token again
    # a repetition penalty on token 1 (5.0 / 2 < 4.0) moves the pick
    assert Sampler(SamplingConfig(repetition_penalty=2.0))(logits, torch.tensor([1])) == 2
    assert Sampler(SamplingConfig())(logits) == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_logit_stops_the_reply_with_one_line(bad):
    logits = torch.randn(1000)
    logits[700] = bad
    with pytest.raises(NonFiniteLogitsError, match="NaN" if math.isnan(bad) else "inf"):
        Sampler(SamplingConfig())(logits)
