"""``python -m engine.tools.bench_peers`` against a real ``engine serve`` process on stories260K (short runs), and the
server's thread rule (``engine.model.threads.for_server``) as its startup line and ``/metrics`` say it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from engine.model import threads
from engine.tools import bench_peers

DEADLINE_S = 120


@pytest.fixture(scope="module")
def served(stories_path):
    """``python -m engine serve`` on a free port: (its startup line, its base URL)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVSCOPE_THREADS", "OMP_NUM_THREADS")}
    p = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(stories_path), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert line.startswith("KV Scope serves stories260K at http://127.0.0.1:"), (line, p.stderr.read())
        yield line, line.split(" at ")[1].split()[0].removesuffix("/v1")
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(DEADLINE_S)
        finally:
            p.kill() if p.poll() is None else None


def test_the_server_states_its_threads_at_start_and_in_metrics(served):
    line, url = served
    assert "CPU threads: 1 (a model under 50M parameters: threads only add overhead)" in line
    text = httpx.get(f"{url}/metrics", timeout=DEADLINE_S).text
    assert 'kvscope_cpu_threads{reason="1 (a model under 50M parameters: threads only add overhead)"} 1' in text


def test_side_by_side_streams_and_shared_prefix_with_ratios(served, tmp_path, capsys):
    _, url = served
    out = tmp_path / "peers.json"
    rc = bench_peers.main([url, url + "/", "--names", "one,two", "--clients", "1,3", "--prompt-tokens", "24",
                           "--new-tokens", "6", "--shared-prefix", "64", "--prefix-requests", "3", "--rounds", "1",
                           "--quiet", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    one = res["medians"]["one"]
    assert one["streams_1"]["tokens"] == 6 and one["streams_3"]["tokens"] == 18  # usage.completion_tokens
    assert one["streams_3"]["tokens_per_s"] > 0 and one["streams_3"]["ttft_ms"] > 0
    assert one["shared_prefix"]["rest_cached_tokens"] == 64  # the 4 pages of 16 the prefix filled
    assert set(res["ratios_to_reference"]["two"]) == {"streams_1", "streams_3", "shared_prefix"}
    assert res["ratios_to_reference"]["two"]["streams_3"]["tokens"] == 1.0
    table = capsys.readouterr().out
    assert "| streams_3 | tokens_per_s |" in table and "two ÷ one" in table


def test_warm_up_rounds_run_first_on_prompts_of_their_own_and_are_not_counted(served, tmp_path, capsys, monkeypatch):
    _, url = served
    drawn = []
    real = bench_peers._ids
    monkeypatch.setattr(bench_peers, "_ids", lambda rng, n, vocab: drawn.append(real(rng, n, vocab)) or drawn[-1])
    out = tmp_path / "peers.json"
    argv = [url, "--names", "one", "--clients", "1", "--prompt-tokens", "20", "--new-tokens", "2", "--shared-prefix",
            "0", "--prefix-requests", "2", "--rounds", "1", "--warmup", "1", "--json", str(out)]
    assert bench_peers.main(argv) == 0
    said = capsys.readouterr().out
    assert "warm-up 1 one 1 client(s)" in said and "round 1 one 1 client(s)" in said
    res = json.loads(out.read_text())
    assert len(res["rounds"]["one"]["streams_1"]) == 1 and res["settings"]["warmup"] == 1  # the warm-up not counted
    warm, measured = drawn[0], drawn[3]  # each round: the prompt, then the two questions
    assert warm != measured
    assert bench_peers.main(argv + ["--seed", "7", "--warmup", "0"]) == 0
    assert drawn[6] != measured  # another seed, other prompts
    assert bench_peers.main(argv + ["--warmup", "0"]) == 0
    assert drawn[9] == measured  # the same seed, the same prompts


@pytest.mark.parametrize("argv, says", [
    (["http://127.0.0.1:1"], "http://127.0.0.1:1: "),  # nothing listens there
    (["localhost:8000"], "a server is http(s)://HOST:PORT"),
    (["http://a:1", "--clients", "0"], "--clients: each 1..256"),
    (["http://a:1", "--clients", "x"], "--clients: 'x' is not a comma-separated list of numbers"),
    (["http://a:1", "http://b:1", "--names", "x"], "--names: 1 names for 2 servers"),
])
def test_bad_arguments_and_unreachable_servers_get_one_line(argv, says, capsys):
    try:
        rc = bench_peers.main(argv)
    except SystemExit as stop:  # argparse's checks
        rc = stop.code
    err = capsys.readouterr().err
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1


def test_the_server_rule_takes_every_physical_core_for_a_large_model(monkeypatch):
    monkeypatch.delenv("KVSCOPE_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n = threads.physical_cores()
    assert 1 <= n <= threads.cores()
    assert threads.for_server(135_000_000, "cpu") == (n, f"{n} (every physical core: a server)")
    assert threads.for_server(260_000, "cpu")[0] == 1
    monkeypatch.setenv("KVSCOPE_THREADS", "3")
    assert threads.for_server(135_000_000, "cpu") == (3, "3 (KVSCOPE_THREADS)")
