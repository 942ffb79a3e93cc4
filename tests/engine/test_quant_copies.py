"""Quantized copies (``engine.model.quant_copies``): a folder loaded with ``--quantize int8`` / ``nf4`` keeps its
blocks in the cache, and the next load of the same files maps them instead of quantizing again — the same bytes, the
same greedy tokens, the folder's weight pages never read. A folder changed after its copy was made, a copy cut
short or not a copy at all, a budget too small for it, copies turned off: the folder is quantized again (a broken
copy removed), and the load never fails for a copy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, ModelSpec
from engine.model import fit, q8_load, quant_copies
from engine.model.weights_plan import Held
from engine.model.loader import load_model
from engine.quant import kernel
from engine.quant.modules import BlockLinear

pytestmark = pytest.mark.skipif(kernel.library() is None or not q8_load.available("cpu"),
                                reason="no GGUF block kernels on this machine")
PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    where = tmp_path / "copies"
    monkeypatch.setenv(quant_copies.ENV, str(where))
    return where


@pytest.fixture(scope="module")
def folder(tmp_path_factory, stories_path) -> Path:
    from test_fit import _folder  # tests/engine is on sys.path

    return _folder(tmp_path_factory.mktemp("copies") / "llama", stories_path)


def _load(folder: Path, kind: str):
    lm = load_model(ModelSpec(source=str(folder), quantization=kind, device="cpu"))
    quant_copies.wait()
    return lm


def _rows(lm) -> dict[str, torch.Tensor]:
    return {n: m.rows().clone() for n, m in lm.model.named_modules() if isinstance(m, BlockLinear)}


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.split()[-1] == str(path.resolve()) for line in maps)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_the_second_load_maps_the_first_loads_blocks(kind, folder, cache):
    from test_exact import engine_greedy

    spec = ModelSpec(source=str(folder), quantization=kind, device="cpu")
    assert fit.estimate_path(folder, spec, "cpu").weights.held == Held.QUANTIZED
    first = _load(folder, kind)
    assert fit.estimate_path(folder, spec, "cpu").weights.held == Held.COPIED  # the verdict says it too
    copies = list(cache.glob(f"{kind}-*.safetensors"))
    assert len(copies) == 1 and not list(cache.glob("*.tmp"))
    assert f"kept in {copies[0]} for the next load" in first.info.weights_kernel
    assert first.info.weights_held == "quantized"
    want_rows, want = _rows(first), engine_greedy(first, PROMPT, 12, CacheConfig())
    second = _load(folder, kind)
    assert f"blocks mapped from {copies[0]}" in second.info.weights_kernel and second.info.weights_held == "copied"
    assert _mapped(copies[0])  # the blocks are the copy's pages
    got_rows = _rows(second)
    assert got_rows.keys() == want_rows.keys() and len(got_rows) == 2 * 7
    assert all(torch.equal(got_rows[n], want_rows[n]) for n in want_rows)  # bit for bit
    assert engine_greedy(second, PROMPT, 12, CacheConfig()) == want
    assert second.info.weights_format == first.info.weights_format
    assert second.info.weights_bytes == first.info.weights_bytes


def test_a_changed_folder_gets_a_new_copy(folder, cache, tmp_path):
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)  # (times kept: the same names, sizes, times and headers as ``folder``'s)
    _load(folder, "int8")
    assert "quantized from the folder at load" in _load(edited, "int8").info.weights_kernel  # another place
    weights = next(edited.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the same bytes, touched: another copy
    lm = _load(edited, "int8")
    assert "quantized from the folder at load" in lm.info.weights_kernel
    assert len(list(cache.glob("int8-*.safetensors"))) == 3
    assert "blocks mapped from" in _load(edited, "int8").info.weights_kernel


@pytest.mark.parametrize("damage", ["cut", "not json", "other tensors", "empty"])
def test_a_broken_copy_is_removed_and_the_folder_quantized_again(damage, folder, cache):
    from test_exact import engine_greedy

    want = engine_greedy(_load(folder, "int8"), PROMPT, 8, CacheConfig())
    (path,) = cache.glob("int8-*.safetensors")
    data = path.read_bytes()
    if damage == "cut":
        data = data[:len(data) - 1000]
    elif damage == "not json":
        data = data[:8] + b"{" * 200 + data[208:]
    elif damage == "other tensors":
        data = data.replace(b"q_proj", b"x_proj", 1)
    else:
        data = b""
    path.write_bytes(data)
    lm = _load(folder, "int8")
    assert "quantized from the folder at load" in lm.info.weights_kernel  # the broken copy was not used
    assert lm.info.weights_held == "quantized"  # though the verdict before the load expected the copy
    assert engine_greedy(lm, PROMPT, 8, CacheConfig()) == want
    assert path.stat().st_size > 1000 and path.read_bytes() != data  # removed, then made again


def test_the_budget_keeps_the_latest_copies_and_refuses_a_copy_larger_than_itself(folder, cache, monkeypatch,
                                                                                     tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(folder, other, copy_function=shutil.copy)  # new modification times: another copy, as large
    _load(folder, "int8")
    (first,) = cache.glob("int8-*.safetensors")
    size = first.stat().st_size
    mine = [cache / "model.safetensors", cache / "notes.tmp"]  # a user's own files in the folder chosen
    for f in mine:
        f.write_bytes(b"x" * 100)
        os.utime(f, (1, 1))  # older than any copy and than a stale temporary file
    monkeypatch.setenv(quant_copies.BUDGET_ENV, str(1.5 * size / (1 << 30)))  # room for one copy, not two
    _load(other, "int8")
    (kept,) = cache.glob("int8-*.safetensors")  # the least recently loaded went
    assert kept != first
    monkeypatch.setenv(quant_copies.BUDGET_ENV, str(size / 4 / (1 << 30)))
    lm = _load(folder, "int8")
    assert "no copy kept" in lm.info.weights_kernel
    assert list(cache.glob("int8-*.safetensors")) == [kept] and not list(cache.glob("int8-*.tmp"))
    assert all(f.read_bytes() == b"x" * 100 for f in mine)  # evicting copies never touched them


def test_copies_off_writes_nothing(folder, cache, monkeypatch):
    monkeypatch.setenv(quant_copies.ENV, "off")
    lm = _load(folder, "int8")
    assert "no copy kept" in lm.info.weights_kernel and not cache.exists()


def test_a_disk_that_fails_mid_copy_drops_the_copy_and_keeps_the_load(folder, cache):
    """Writes past 64 KiB fail as on a full disk (RLIMIT_FSIZE: EFBIG, in a child so that the limit is its own):
    the copy's header fits, its first tensor does not. The load goes on, says no copy is kept, leaves no file."""
    import subprocess
    import sys

    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))\n"
        "from engine.config import ModelSpec\n"
        "from engine.model import quant_copies\n"
        "from engine.model.loader import load_model\n"
        "lm = load_model(ModelSpec(source=sys.argv[1], quantization='int8', device='cpu'))\n"
        "quant_copies.wait()\n"
        "print(lm.info.weights_kernel)\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no copy kept" in r.stdout
    assert "the quantized copy of this folder is not kept" in r.stderr  # the log's one line: why
    assert not cache.exists() or not list(cache.iterdir())  # no copy, no temporary file


def test_a_stale_temporary_file_is_removed(folder, cache):
    cache.mkdir(parents=True)
    stale = cache / "int8-0123.safetensors.999.tmp"
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (1, 1))
    _load(folder, "int8")
    assert not stale.exists() and len(list(cache.glob("int8-*.safetensors"))) == 1


def test_the_copy_is_a_safetensors_file_of_the_blocks(folder, cache):
    """Any safetensors reader opens a copy: uint8 [rows, row_bytes] tensors named as the folder's weights."""
    from safetensors import safe_open

    lm = _load(folder, "int8")
    (path,) = cache.glob("int8-*.safetensors")
    q = lm.model.model.layers[0].self_attn.q_proj
    with safe_open(str(path), "pt") as f:
        assert len(list(f.keys())) == 2 * 7
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.weight"), q.rows())


def test_held_counts_the_copies_and_clear_removes_only_them(folder, cache):
    """Settings ▸ Quantized copies shows ``held()`` and its Clear is ``clear()``: the copies and the temporary files no
    load writes go; a user's own files there, and a copy this process is writing now, stay."""
    _load(folder, "int8")
    _load(folder, "nf4")
    copies = sorted(cache.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in copies)
    assert len(copies) == 2 and size > 0
    dead = cache / f"{copies[0].name}.999999999.tmp"  # a load that died (no such process) a minute ago
    dead.write_bytes(b"x" * 100)
    live = cache / f"{copies[0].name}.{os.getpid()}.tmp"  # this process writes it now
    live.write_bytes(b"y" * 10)
    own = [cache / "notes.txt", cache / "int8-mine.bin", cache / "model.safetensors"]
    for p in own:
        p.write_bytes(b"z" * 7)
    assert quant_copies.held() == (2, size + 110)
    assert quant_copies.clear() == size + 100
    assert quant_copies.held() == (0, 10) and live.exists() and not dead.exists()
    assert all(p.read_bytes() == b"z" * 7 for p in own)
    lm = _load(folder, "int8")  # cleared: quantized again, a new copy kept
    assert "quantized from the folder at load" in lm.info.weights_kernel and quant_copies.held()[0] == 1
    assert quant_copies.held(cache / "missing") == (0, 0) and quant_copies.clear(cache / "missing") == 0
