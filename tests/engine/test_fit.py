"""Will it fit? (``engine.model.fit``): the memory a model will take, said before it loads, against what real loads
hold — the weights as held (``ModelInfo.weights_bytes`` of the loaded model: float32, bfloat16, bitsandbytes int8
and NF4), the KV cache's bytes per token (the model's probe and a real paged session), the longest context — and the
refusal, with its numbers, of what cannot fit on a machine made small by ``KVSCOPE_AVAILABLE_MEMORY`` (the engine's
own budget variable, not a mock: the load is refused before a weight is read). The within-10% check against measured
RSS of 1B-shape loads is ``tests/engine/measure_fit.py``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, ModelSpec
from engine.model import fit, q8_load
from engine.model.fit_check import human_bytes
from engine.model.loader import load_model
from engine.quant import kernel
from engine.model.weights_plan import Held
from engine.tools.cli import main

SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)


def _folder(path: Path, stories_path: Path, arch: str = "llama", dtype=torch.bfloat16, **kw) -> Path:
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**SHAPE, **kw})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(stories_path / name, path / name)
    return path


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory, stories_path) -> Path:
    return _folder(tmp_path_factory.mktemp("fit") / "llama-bf16", stories_path)


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory, stories_path) -> Path:
    """122M parameters (244 MB in bfloat16): the weights, not the libraries, decide what fits."""
    return _folder(tmp_path_factory.mktemp("fit") / "wide-bf16", stories_path, hidden_size=2048,
                   intermediate_size=8192, num_attention_heads=16, head_dim=128)


@pytest.mark.parametrize("quant,dtype,held,fmt", [
    ("none", "auto", Held.CONVERTED, "F32"),  # a CPU computes in float32 unless told
    ("none", "bfloat16", Held.MAPPED if kernel.library() else Held.READ, "BF16"),  # the files' pages
    ("int8", "auto", Held.QUANTIZED, "Q8_0" if q8_load.available("cpu") else "int8"),  # the block kernels' format
    ("nf4", "auto", Held.QUANTIZED, "NF4"),
])
def test_weights_as_held_match_the_loaded_model(bf16_folder, quant, dtype, held, fmt):
    spec = ModelSpec(source=str(bf16_folder), quantization=quant, dtype=dtype, device="cpu")
    verdict = fit.estimate_path(bf16_folder, spec, "cpu")
    lm = load_model(spec)
    w, info = verdict.weights, lm.info
    assert (w.held, w.format, w.stored) == (held, fmt, "BF16")
    assert (info.weights_format, info.weights_held, info.weights_stored) == (fmt, str(held), "BF16")
    if quant == "nf4":  # bitsandbytes' AVX512-BF16 path turns the float32 block scales into bfloat16 when first run
        assert 0 <= w.bytes - info.weights_bytes <= 2 * w.params // 64
    else:
        assert w.bytes == info.weights_bytes
    assert w.params == sum(p.numel() for p in lm.model.parameters()) or quant != "none" or held == Held.MAPPED
    assert verdict.cost("auto").bytes_per_token == info.kv_bytes_per_token
    assert verdict.compute_dtype == info.kv_dtype


def test_sliding_and_hybrid_layers_cost_what_the_model_info_says(tmp_path, stories_path):
    """Gemma-2's sliding layers hold the window less one token, its full layers every token: the estimate's bytes
    at any context equal ``ModelInfo.kv_bytes_at`` (from the probe of the loaded model)."""
    folder = _folder(tmp_path / "gemma2", stories_path, "gemma2", dtype=torch.float32, head_dim=16,
                     sliding_window=8, bos_token_id=2, eos_token_id=1)
    spec = ModelSpec(source=str(folder), device="cpu")
    verdict = fit.estimate_path(folder, spec, "cpu")
    info = load_model(spec).info
    attn = fit.attention_of(json.loads((folder / "config.json").read_text()))
    assert attn.sliding and attn.full
    layer = attn.per_token("auto", 4)
    for tokens in (1, 5, 7, 8, 100, 1000):
        assert attn.bytes_at(tokens, layer) == info.kv_bytes_at(tokens)
    assert verdict.cost("auto").bytes_per_token == info.kv_bytes_per_token


def test_quantized_pages_cost_what_a_paged_session_holds(bf16_folder):
    """int8 and int4 K/V: the estimate's cache at 64 tokens is what the session's snapshot counts: three quantized
    pages and the page being filled, at full precision until it is whole."""
    from engine.core.session import ChatSession
    from engine.config import SamplingConfig
    from engine.core.scheduler import drive

    spec = ModelSpec(source=str(bf16_folder), device="cpu")
    verdict = fit.estimate_path(bf16_folder, spec, "cpu")
    lm = load_model(spec)
    for kind in ("int8", "int4"):
        session = ChatSession(lm, CacheConfig(k_dtype=kind, v_dtype=kind))
        session.start_ids([1] + [5 + i % 400 for i in range(62)],
                                     SamplingConfig(max_new_tokens=1, ignore_eos=True))
        last = list(drive(session))[-1]
        assert last.snapshot.kv_bytes == verdict.kv_bytes(kind, 64)


@settings(max_examples=200, deadline=None)
@given(full=st.integers(0, 40), sliding=st.integers(0, 40), window=st.integers(2, 4096),
       kind=st.sampled_from(fit.KV_KINDS), elem=st.sampled_from([2, 4]), budget=st.integers(0, 1 << 34))
def test_longest_context_is_the_most_tokens_the_budget_holds(full, sliding, window, kind, elem, budget):
    attn = fit.Attention(full, sliding, window if sliding else 0, 8, 64)
    cap = 1 << 22
    n = attn.longest(kind, elem, budget, cap)

    def need(t):
        return attn.cache_bytes(kind, elem, t) + attn.working_bytes(kind, elem, t)

    assert 0 <= n <= cap
    if full + sliding and n:
        assert need(n) <= budget
    if n < cap:
        assert need(n + 1) > budget


def test_available_memory_reads_the_variable(monkeypatch):
    monkeypatch.setenv(fit.ENV, "1.5GiB")
    assert fit.available_memory("cpu") == (3 << 29, fit.ENV)
    for text, want in (("800MB", 800_000_000), ("2g", 2 << 30), ("123456", 123456), ("64 KiB", 65536)):
        assert fit.parse_bytes(text) == want
    with pytest.raises(ValueError, match="expected a size"):
        fit.parse_bytes("lots")


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_model_that_cannot_fit_is_refused_with_its_numbers_before_a_weight_is_read(wide_folder, monkeypatch,
                                                                                       capsys):
    need = fit.estimate_path(wide_folder, ModelSpec(source="x", device="cpu"), "cpu", 1 << 40)
    nf4 = ModelSpec(source="x", quantization="nf4", device="cpu")
    small = fit.estimate_path(wide_folder, nf4, "cpu", 1 << 40)
    budget = max(small.load_bytes, small.libraries + small.runtime + small.weights.bytes + small.compute_at(1024)
                 + int(small.kv_bytes("auto", 1024)))
    small = fit.estimate_path(wide_folder, nf4, "cpu", budget)
    assert small.fits and budget < need.load_bytes  # float32 does not fit, NF4 does
    monkeypatch.setenv(fit.ENV, str(budget))
    seen = []
    with pytest.raises(fit.WontFitError) as e:
        load_model(ModelSpec(source=str(wide_folder), device="cpu"), progress=lambda m, f: seen.append(m))
    assert not any("tensor" in m for m in seen)  # refused before the weights' progress began
    assert not e.value.fit.fits and e.value.fit.available == budget
    rc, out, err = _run(capsys, "generate", "--model", str(wide_folder), "--prompt", "Once", "--device", "cpu")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {wide_folder.name} will not fit: loading needs {human_bytes(need.load_bytes)} "
                          f"(weights {human_bytes(need.weights.bytes)} as F32")
    assert f"{human_bytes(budget)} of {fit.ENV} is available" in err
    assert f"--quantize nf4 needs {human_bytes(small.load_bytes)}" in err
    assert "Traceback" not in err


def test_too_little_room_for_the_cache_is_refused_too(wide_folder, monkeypatch, capsys):
    f = fit.estimate_path(wide_folder, ModelSpec(source="x", device="cpu"), "cpu", 1 << 40)
    budget = f.load_bytes  # the weights load, but a 512-token context at any precision does not fit beside them
    f = fit.estimate_path(wide_folder, ModelSpec(source="x", device="cpu"), "cpu", budget)
    assert max(k.longest_context for k in f.kv) < 512
    monkeypatch.setenv(fit.ENV, str(budget))
    rc, _, err = _run(capsys, "generate", "--model", str(wide_folder), "--prompt", "Once", "--device", "cpu")
    best = max(f.kv, key=lambda k: k.longest_context)
    assert rc == 2 and f"the KV cache has room for {best.longest_context:,} tokens at most" in err
    assert "fewer than 512" in err


def test_a_bad_budget_is_one_line(monkeypatch, capsys, stories_path):
    monkeypatch.setenv(fit.ENV, "a lot")
    rc, _, err = _run(capsys, "models", "--folder", str(stories_path))
    assert rc == 2 and err.strip() == f"error: {fit.ENV}='a lot': expected a size such as 8GiB, 800MB or 123456 (bytes)"


def test_the_verdict_is_said_before_the_load(stories_path, capsys):
    rc, out, err = _run(capsys, "generate", "--model", str(stories_path), "--prompt", "Once", "--max-new-tokens", "2",
                        "--device", "cpu")
    assert rc == 0
    note = next(line for line in err.splitlines() if line.startswith("note: stories260K: weights"))
    assert "F32, 32.00 bits per weight, read as stored" in note
    assert "KV cache per token: float32 1.2 KiB, int8 400 B" in note
    assert "its whole context (512 tokens) fits at every precision" in note


def test_models_lists_folders_and_gguf_files_with_their_memory(tmp_path, stories_path, bf16_folder, capsys,
                                                                monkeypatch):
    import shutil

    from gguf_make import write_gguf  # tests/engine is on sys.path
    from transformers import AutoModelForCausalLM

    root = tmp_path / "models"
    shutil.copytree(bf16_folder, root / "llama-bf16")
    model = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=torch.float32)
    gguf_path = write_gguf(model, "llama", stories_path / "tokenizer.model", root / "llama-q8_0.gguf", "Q8_0")
    (root / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    monkeypatch.setenv("HOME", str(tmp_path))  # no store of this machine's user in the listing
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv(fit.ENV, "4GiB")
    rc, out, _ = _run(capsys, "models", "--folder", str(root), "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["available_bytes"] == 4 << 30 and data["available_from"] == fit.ENV
    rows = {r["name"]: r for r in data["models"]}
    folder, q8, broken = rows["llama-bf16"], rows["llama-q8_0.gguf"], rows["broken.gguf"]
    assert (folder["format"], folder["stored_format"], folder["held"]) == ("F32", "BF16", "converted")
    assert folder["memory_bytes"] == 2 * sum(p.stat().st_size for p in (root / "llama-bf16").glob("*.safetensors")) \
        - 2 * _header_bytes(root / "llama-bf16")
    held = "repacked" if kernel.packs(8) else "mapped"  # sixteen rows a group for AVX-512 VNNI, else the file's
    assert (q8["format"], q8["held"], q8["fits"]) == ("Q8_0", held, True)
    assert q8["kv"]["auto"]["bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # 2 layers, K and V, 2 heads of 32, float32
    assert q8["kv"]["int8"]["longest_context"] == 1024
    assert q8["memory_bytes"] < gguf_path.stat().st_size and broken["problem"]
    rc, out, _ = _run(capsys, "models", "--folder", str(root), "--kv-dtype", "int8")
    line = next(x for x in out.splitlines() if x.startswith("llama-q8_0.gguf"))
    assert 8.5 <= q8["bits_per_weight"] < 8.6  # 34 bytes a block of 32, and the float32 norms
    assert f"Q8_0 ({q8['bits_per_weight']:.2f} bits/weight, {held})" in line
    assert "KV 272 B/token (int8)" in line and "longest context 1,024 of 1,024" in line


def _header_bytes(folder: Path) -> int:
    """The safetensors files' headers (8-byte length + JSON): what a file holds beyond its tensors' bytes."""
    import struct

    total = 0
    for p in folder.glob("*.safetensors"):
        with open(p, "rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_table_held_as_a_copy_for_its_head_counts_its_pages_while_running(tmp_path, stories_path, tied):
    """A tied GGUF table whose head is repacked is held twice once a chat runs: the head's copy, and the file's
    pages the lookups map again (a whole large folio a row on this kernel: a Llama-3-vocabulary 1B's 205 MiB table
    all mapped after ~640 lookups). The running estimate counts the table's bytes; the load's peak does not."""
    from gguf_make import write_gguf  # tests/engine is on sys.path
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.quant import formats

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(SHAPE, tie_word_embeddings=tied))).float()
    path = write_gguf(model, "llama", stories_path / "tokenizer.model", tmp_path / "m.gguf", "Q8_0")
    spec = ModelSpec(source=str(path), device="cpu")
    verdict = fit.estimate_path(path, spec, "cpu", available=1 << 34)
    table = formats.file_bytes(8, (SHAPE["vocab_size"], SHAPE["hidden_size"]))  # Q8_0 [512, 128]: 69,632 bytes
    lm = load_model(spec)
    head = lm.model.get_output_embeddings()
    end = time.monotonic() + 60
    while head.pending() and time.monotonic() < end:  # the head's repacking runs on a thread after the load
        time.sleep(0.02)
    copied = tied and head.packed is not None  # repacked: the integer road's layout where this CPU has one
    assert verdict.weights.looked_up == (table if copied else 0), (copied, verdict.weights.looked_up)
    base = dataclasses.replace(verdict, weights=dataclasses.replace(verdict.weights, looked_up=0))
    assert verdict.total_at(64) - base.total_at(64) == verdict.weights.looked_up
    assert verdict.load_bytes == base.load_bytes  # the pages are let go at load; the lookups map them later
