"""Loading: demo, bitsandbytes int8/nf4 on CPU, the HF cache, offline downloads, device choice."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from engine import errors
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.model.loader import choose_device, load_model
from engine.core.session import ChatSession


def _generate(lm, n=20):
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=8))
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=n, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    return s.generated_ids, r


def test_demo_model_is_labelled_and_deterministic(demo_model):
    info = demo_model.info
    assert info.is_demo and "random weights" in info.name
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == (4, 8, 2, 16)
    assert info.attention_kind == "GQA"
    assert info.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4
    again = load_model("demo")
    a, _ = _generate(demo_model)
    b, _ = _generate(again)
    assert a == b and len(a) == 20
    assert info.has_chat_template


def test_stories_info_and_stop_ids(stories):
    info = stories.info
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == (5, 8, 4, 8)
    assert info.context_length == 512
    assert stories.stop_ids == (2, 1)
    assert info.weights_bytes == 260_032 * 4
    assert info.kv_bytes_per_token == 2 * 5 * 4 * 8 * 4
    assert info.kv_bytes_per_token_as(info.num_q_heads) == 2 * info.kv_bytes_per_token
    assert info.kv_bytes_per_token_as(1) == info.kv_bytes_per_token // 4
    assert info.device == "cpu" and info.device_reason.startswith("CPU")


def test_generation_stops_on_any_stop_id(stories):
    s = ChatSession(stories, CacheConfig())
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=400))
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "eos"
    assert s.generated_ids[-1] in (1, 2)
    assert r.text and "</s>" not in r.text


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_8bit_and_4bit_load_and_generate_on_cpu(stories_path, stories, quant):
    import bitsandbytes as bnb

    lm = load_model(ModelSpec(source=str(stories_path), quantization=quant, device="cpu"))
    kinds = {type(m).__name__ for m in lm.model.modules()}
    from engine.model import q8_load

    # int8 on a CPU with the GGUF block kernels: Q8_0 blocks (engine.model.q8_load); else bitsandbytes' LLM.int8
    int8 = "BlockLinear" if q8_load.available("cpu") else "Linear8bitLt"
    assert (int8 if quant == "int8" else "Linear4bit") in kinds
    assert lm.info.quantization == quant
    # the quantized linear layers hold fewer bytes than float32 (embeddings stay float32)
    assert lm.info.weights_bytes < stories.info.weights_bytes
    # the weights counted as weights, not as the bytes that hold them: a prefill chunk and the threads follow them
    from engine.quant.modules import parameter_count

    assert parameter_count(lm.model) == parameter_count(stories.model) == 260_032  # numel: 270,752 / 157,472
    ids, r = _generate(lm, 30)
    assert len(ids) == 30 and r.snapshot.weights_bytes == lm.info.weights_bytes
    assert r.snapshot.kv_bytes > 0
    full, _ = _generate(stories, 30)
    agree = sum(a == b for a, b in zip(ids, full))
    assert agree >= 5  # a quantized model still tells roughly the same story
    del bnb


def test_hub_id_from_local_cache(tmp_path, monkeypatch, stories_path):
    """A hub id already in the HF cache loads without network."""
    cache = tmp_path / "hub"
    snap = cache / "models--karpathy--stories260K" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in stories_path.iterdir():
        shutil.copy(f, snap / f.name)
    (cache / "models--karpathy--stories260K" / "refs").mkdir()
    (cache / "models--karpathy--stories260K" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    lm = load_model(ModelSpec(source="karpathy/stories260K"))
    assert lm.info.num_layers == 5 and lm.path == str(snap)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_download_unreachable_hub_fails_fast_with_clear_message(tmp_path):
    """A hub id not in the cache, with the hub endpoint pointing at a closed local port."""
    code = (
        "from engine.model.loader import load_model\n"
        "from engine.config import ModelSpec\n"
        "from engine import errors\n"
        "try:\n"
        "    load_model(ModelSpec(source='someone/not-cached-model'))\n"
        "except errors.OfflineError as e:\n"
        "    print('OFFLINE:', e)\n"
    )
    env = {**__import__("os").environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
           "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "3",
           "HF_HUB_DOWNLOAD_TIMEOUT": "3"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "OFFLINE: cannot download someone/not-cached-model" in p.stdout, p.stderr[-2000:]


def test_offline_flag_refuses_download(capsys):
    from engine.tools.cli import main

    rc = main(["generate", "--model", "someone/not-cached-model", "--prompt", "x", "--offline"])
    err = capsys.readouterr().err
    assert rc == 2 and "not in the local Hugging Face cache" in err


def test_device_choice_explains_itself():
    dev, why = choose_device("auto")
    if not torch.cuda.is_available():
        assert dev in ("cpu", "mps") and ("no CUDA" in why)
        with pytest.raises(errors.EngineError, match="no CUDA device"):
            choose_device("cuda")
    assert choose_device("cpu") == ("cpu", "CPU: chosen")


def test_import_engine_never_imports_qt():
    code = ("import sys, engine, engine.core.session, engine.model.loader, engine.tools.cli, engine.tools.bench\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'pyqtgraph', 'app', 'shiboken6')]\n"
            "print(bad)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_import_engine_is_light():
    """``import engine`` alone must not pull torch (the app's window opens before torch loads)."""
    p = subprocess.run([sys.executable, "-c", "import sys, engine; print('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "False", p.stderr


def test_cli_generate_json_fields(stories_path, tmp_path, capsys):
    from engine.tools.cli import main

    rc = main(["generate", "--model", str(stories_path), "--prompt", "Once upon a time", "--max-new-tokens", "12",
               "--json", "--cache", "paged", "--page-size", "4"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert set(out) >= {"token_ids", "text", "prompt_tokens", "reused_tokens", "ttft_ms", "decode_tokens_per_s",
                        "kv_bytes", "pages_used", "stop_reason"}
    assert len(out["token_ids"]) == 12 and out["prompt_tokens"] == 5 and out["stop_reason"] == "max_tokens"
    assert out["text"].startswith(", there was a little girl")
    assert out["pages_used"] == -(-(5 + 11) // 4)
    assert out["kv_bytes"] == out["pages_used"] * 4 * 1280
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Hi"}, {"role": "user", "content": "Tell me more"}]))
    rc = main(["generate", "--model", str(stories_path), "--messages", str(msgs), "--max-new-tokens", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(out["turns"]) == 2
    assert out["turns"][0]["reused_tokens"] == 0 and out["turns"][1]["reused_tokens"] > 0


def test_bench_writes_rows_for_every_mode(tmp_path, capsys):
    from engine.tools.cli import main

    f = tmp_path / "b.json"
    rc = main(["bench", "--shape", "tiny-llama", "--contexts", "32,64", "--new-tokens", "6", "--json", str(f),
               "--reuse-history", "120"])
    assert rc == 0
    data = json.loads(f.read_text())
    got = {(r["engine"], r["mode"], r["context"]) for r in data["rows"]}
    for ctx in (32, 64):
        for em in (("hf", "dynamic"), ("hf", "no_cache"), ("kvscope", "off"), ("kvscope", "contiguous"),
                   ("kvscope", "paged")):
            assert (*em, ctx) in got
    for r in data["rows"]:
        assert r["new_tokens"] == 6 and r["ttft_ms"] > 0 and r["decode_tokens_per_s"] > 0
        if r["mode"] in ("no_cache", "off"):
            assert r["kv_bytes"] == 0
    hf64 = next(r for r in data["rows"] if r["mode"] == "dynamic" and r["context"] == 64)
    assert hf64["kv_bytes"] == (64 + 5) * 2 * 3 * 2 * 16 * 4  # HF keeps L+N-1 positions
    assert data["turn_reuse"]["reused_tokens"] == 120


def test_load_reports_per_tensor_progress_and_can_be_cancelled_mid_weights(stories_path):
    import threading

    seen: list[tuple[str, float]] = []
    cancel = threading.Event()

    def progress(message: str, fraction: float) -> None:
        seen.append((message, fraction))
        if sum("tensor" in m for m, _ in seen) == 3:
            cancel.set()  # from the callback here; the app sets it from the GUI thread

    with pytest.raises(errors.LoadCancelled, match="cancelled"):
        load_model(str(stories_path), progress=progress, cancel=cancel)
    tensors = [(m, f) for m, f in seen if "tensor" in m]
    assert [m for m, _ in tensors] == [f"loading stories260K: tensor {i} of 47" for i in (1, 2, 3)]
    assert [f for _, f in tensors] == sorted(f for _, f in tensors) and 0.1 < tensors[0][1] < tensors[-1][1] < 0.95
    # the hook is gone afterwards: a normal load runs to the end and reports the last stages
    seen.clear()
    lm = load_model(str(stories_path), progress=progress)
    assert lm.info.name == "stories260K" and seen[-1][1] == pytest.approx(0.97)
    already = threading.Event()
    already.set()
    with pytest.raises(errors.LoadCancelled):
        load_model(str(stories_path), cancel=already)


def test_cpu_fallback_says_why(monkeypatch):
    """A CUDA build of torch on a machine without the NVIDIA driver (this one: no libcuda.so.1) says so."""
    import torch

    from engine.model.loader import choose_device, no_gpu_reason

    assert choose_device("auto") == ("cpu", no_gpu_reason())
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert no_gpu_reason() == "CPU: no NVIDIA driver found (libcuda.so.1 is missing; this build uses CUDA 13.0)"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert no_gpu_reason() == "CPU: no CUDA or MPS device"
