"""The KV events attack of #29, measured against a real ``python -m engine serve`` (stories260K, two API keys,
events and replay on loopback): what listens where, what a key-less subscriber reads of both tenants, the
server's peak memory when a 256 MB frame is sent to the replay socket, and its throughput with and without a
replay flood. One run each; prints one JSON object. Not a test (timings): ``python tests/engine/measure_kv_events_attack.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import zmq

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "resources" / "models" / "stories260K"
KEYS = ("tenant-a", "tenant-b")
# the server on CPU 0, the flooder and this client on CPU 1: a flood's own CPU does not slow the server down
# (on 2 cores it took half of the server's time), so what changes is what the server does for it
PIN_SERVER, PIN_OTHERS = (["taskset", "-c", "0"], ["taskset", "-c", "1"]) if os.cpu_count() >= 2 else ([], [])
TEXTS = ("Tenant A's secret plan is to sail at dawn. " * 4, "Tenant B's password is hunter2 and blue. " * 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*extra: str) -> tuple[subprocess.Popen, str, str, str]:
    port, ev, rep = free_port(), free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{ev}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
    cmd = [*PIN_SERVER, sys.executable, "-m", "engine", "serve", "--model", str(MODEL), "--port", str(port), "--kv-events-config",
           json.dumps(cfg), *extra]
    for k in KEYS:
        cmd += ["--api-key", k]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    return proc, f"http://127.0.0.1:{port}", cfg["endpoint"], cfg["replay_endpoint"], lines


def listening(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return sorted(line.split()[3] for line in out.splitlines() if f"pid={pid}," in line)


def hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM")).split()[1]) / 1024


def complete(url: str, key: str, text: str, n: int, salt: str | None = None) -> dict:
    body = {"model": "stories260K", "prompt": text, "max_tokens": n, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    if salt:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    r.raise_for_status()
    return r.json()


def what_a_keyless_subscriber_reads(url: str, endpoint: str) -> dict:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)
    sent = [complete(url, KEYS[0], TEXTS[0], 16)["prompt_token_ids"],
            complete(url, KEYS[1], TEXTS[1], 16, salt="b-salt")["prompt_token_ids"]]
    stored, end = [], time.monotonic() + 3
    while time.monotonic() < end:
        if sub.poll(100):
            stored += [e for e in msgpack.unpackb(sub.recv_multipart()[2], raw=False)[1] if e["type"] == "BlockStored"]
    ctx.destroy(linger=0)
    ids = [t for e in stored for t in e["token_ids"]]
    leaked = sum(1 for prompt in sent for i in range(len(prompt) - 3) if _has(ids, prompt[i:i + 4]))
    return {"stored_events": len(stored), "blocks": sum(len(e["block_hashes"]) for e in stored),
            "token_ids_received": len(ids), "prompt_4grams_found": leaked}


def _has(seq: list, sub: list) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def warm(url: str) -> None:
    """~1,000 batches in the replay buffer (a batch per page filled: 40 replies of 256 tokens, pages of 16)."""
    for i in range(40):
        complete(url, KEYS[i % 2], f"warm {i} " + TEXTS[i % 2], 256)


def big_frame(pid: int, replay: str) -> dict:
    before = hwm_mib(pid)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    mon = d.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    d.connect(replay)
    d.send_multipart([b"", b"\0" * (256 << 20)], copy=False)
    dropped = bool(mon.poll(30_000))
    time.sleep(1)
    ctx.destroy(linger=0)
    return {"peak_mib_before": round(before, 1), "peak_mib_after": round(hwm_mib(pid), 1), "disconnected": dropped}


def throughput(url: str, rounds: int = 4, n: int = 200) -> float:
    t, tokens = time.monotonic(), 0
    for i in range(rounds):
        tokens += complete(url, KEYS[i % 2], f"{i}. " + TEXTS[i % 2], n)["usage"]["completion_tokens"]
    return tokens / (time.monotonic() - t)


FLOOD = """
import sys, time, zmq
ctx = zmq.Context(); d = ctx.socket(zmq.DEALER); d.setsockopt(zmq.SNDHWM, 0); d.connect(sys.argv[1])
sent = back = 0
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(100):
        d.send_multipart([b"", (0).to_bytes(8, "big")]); sent += 1
    while d.poll(0):
        d.recv_multipart(); back += 1
print(sent, back)
"""


def flood(replay: str, seconds: float) -> subprocess.Popen:
    """Replay requests as fast as one process sends them (its own process: not this one's GIL), answers read."""
    return subprocess.Popen([*PIN_OTHERS, sys.executable, "-c", FLOOD, replay, str(seconds)], stdout=subprocess.PIPE,
                            text=True)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 10 ms


def main() -> None:
    out: dict = {}
    if PIN_OTHERS:
        os.sched_setaffinity(0, {1})
    proc, url, ev, rep, lines = start()
    try:
        out["startup"] = [x.strip() for x in lines]
        out["listening"] = listening(proc.pid)
        out["keyless_subscriber"] = what_a_keyless_subscriber_reads(url, ev)
        warm(url)
        out["frame_256mb"] = big_frame(proc.pid, rep)
        c0 = cpu_s(proc.pid)
        out["tok_s_quiet"] = round(throughput(url), 1)
        c1 = cpu_s(proc.pid)
        f = flood(rep, 600)
        time.sleep(1)
        c2 = cpu_s(proc.pid)
        out["tok_s_flood"] = round(throughput(url), 1)
        c3 = cpu_s(proc.pid)
        f.kill()
        out["ratio"] = round(out["tok_s_flood"] / out["tok_s_quiet"], 3)
        out["server_cpu_s"] = {"quiet": round(c1 - c0, 2), "flood": round(c3 - c2, 2)}
        m = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
        out["replay_counts"] = [x for x in m.splitlines() if x.startswith("kvscope_kv_events_replay")]
        out["metrics_without_key"] = httpx.get(url + "/metrics").status_code
    finally:
        proc.terminate()
        proc.wait(30)
    refused = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", str(MODEL), "--kv-events-config",
                              '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'], cwd=ROOT,
                             capture_output=True, text=True)
    out["wildcard_without_opt_in"] = {"rc": refused.returncode, "stderr": refused.stderr.strip()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
