"""The remote-engine measures, in one run: ``python tests/remote/measure.py --json out.json``.

1. event → view latency (a batch's server time to its arrival in the view) with 4 concurrent requests, p50 / p95;
2. vLLM throughput with and without a subscribed KV Scope (``engine attach --watch`` in a process of its own, as
   the app is), rounds interleaved (ratio of medians);
3. ``engine serve`` vs vLLM on this machine, the same model (random-weight Llama, head_dim 64, 2 layers), 1 and
   4 clients: decode tokens/s (all clients' tokens over the wall time) and TTFT.
Both servers get the same threads (``--threads``, default: all cores); they run one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vllm_env as env  # noqa: E402
from engine.remote.attach import RemoteEngine  # noqa: E402
from engine.remote.client import RemoteClient  # noqa: E402

PROMPTS = [f"{i} Once upon a time there was a little {w} who liked to play in the park with a red ball."
           for i, w in enumerate(["girl", "boy", "dog", "cat", "bird", "fish", "bear", "frog"])]


def load(url: str, model: str, clients: int, tokens: int, round_no: int) -> dict:
    """``clients`` concurrent chats of ``tokens`` tokens: total tokens / wall time, and each TTFT."""
    out: list = [None] * clients

    def one(i: int) -> None:
        c = RemoteClient(url, timeout=300)
        msg = [{"role": "user", "content": f"r{round_no} " + PROMPTS[i % len(PROMPTS)]}]
        out[i] = c.chat(model, msg, max_tokens=tokens)

    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    n = sum(len(r.token_ids) for r in out)
    return {"tokens_per_s": n / wall, "ttft_ms": [r.ttft_s * 1e3 for r in out if r.ttft_s is not None]}


def serve_numbers(url: str, model: str, rounds: int, tokens: int) -> dict:
    load(url, model, 1, 8, -1)  # warm-up (compiles, first allocations)
    res = {}
    for clients in (1, 4):
        runs = [load(url, model, clients, tokens, r) for r in range(rounds)]
        res[f"{clients}_clients"] = {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
            "ttft_ms_p50": round(statistics.median(t for r in runs for t in r["ttft_ms"]), 1)}
    return res


def with_and_without_view(url: str, model: str, rounds: int, tokens: int) -> dict:
    """Interleaved rounds of 4 clients with a subscribed KV Scope (``python -m engine attach --watch``, a process
    of its own as the app is) and without; then the event → view delay over 2 rounds with a view in this process."""
    on, off = [], []
    for r in range(rounds):
        for attached in ((True, False) if r % 2 == 0 else (False, True)):
            viewer = subprocess.Popen([sys.executable, "-m", "engine", "attach", url, "--watch", "3600"],
                                      cwd=env.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) \
                if attached else None
            time.sleep(1.0)  # subscribed (or idle as long, for the same conditions)
            x = load(url, model, 4, tokens, 100 + r * 2 + attached)
            if viewer is not None:
                viewer.terminate()
                viewer.wait(10)
            (on if attached else off).append(x["tokens_per_s"])
    eng = RemoteEngine(url)
    for r in range(2):
        load(url, model, 4, tokens, 900 + r)
    time.sleep(0.3)
    lat = sorted(eng.view.latencies)
    eng.close()
    pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 2)) if lat else (lambda q: None)
    return {"with_view_tokens_per_s": round(statistics.median(on), 1),
            "without_view_tokens_per_s": round(statistics.median(off), 1),
            "ratio": round(statistics.median(on) / statistics.median(off), 3),
            "event_to_view_ms": {"p50": pct(0.5), "p95": pct(0.95), "batches": len(lat)}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-measure-"))
    model = env.make_model(tmp / "model")
    events = lambda port: {"enable_kv_cache_events": True, "publisher": "zmq",  # noqa: E731
                           "endpoint": f"tcp://*:{port}", "topic": "kv-events"}
    result = {}
    for kind in ("vllm", "kvscope"):
        port = env.free_port()
        if kind == "vllm":
            proc = env.start_vllm(env.ensure_venv(print), model, port, events(env.free_port()), tmp / "vllm.log",
                                  threads=a.threads)
        else:
            proc = env.start_kvscope(model, port, events(env.free_port()), tmp / "kvscope.log", threads=a.threads)
        url = f"http://127.0.0.1:{port}"
        try:
            env.wait_ready(url, proc, 400, tmp / f"{kind}.log")
            name = RemoteClient(url).models()[0]
            result[kind] = serve_numbers(url, name, a.rounds, a.tokens)
            result[kind]["view"] = with_and_without_view(url, name, a.rounds, a.tokens)
        finally:
            env.stop(proc)
        print(kind, json.dumps(result[kind]), flush=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
