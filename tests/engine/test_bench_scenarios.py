"""``bench --prefix-cache N`` and ``--server``: the scenario's figures are the engine's own counts."""

from __future__ import annotations

import json

from engine.tools.cli import main as cli_main


def test_prefix_cache_and_server_scenarios(stories_path, tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = cli_main(["bench", "--model", str(stories_path), "--contexts", "", "--modes", "paged", "--new-tokens", "8",
                   "--prefix-cache", "4", "--shared-prompt", "64", "--server", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    p = d["prefix_cache"]
    assert p["requests"] == 4 and len(p["ttft_ms"]) == 4
    assert p["reused_tokens"][0] == 0 and all(r == 64 for r in p["reused_tokens"][1:])  # 4 full pages of 16
    # each later request holds only its own pages: 4 shared + 2 (24 question + 8 generated tokens)
    assert p["pages_one_request"] == 6 and p["pages_all_requests"] == 4 + 4 * 2
    s = d["server"]
    assert s["api_tokens_per_s"] > 0 and s["direct_tokens_per_s"] > 0 and s["ratio"] > 0
    assert "prefix cache, 4 requests sharing 64 tokens" in capsys.readouterr().err


def test_scenario_flags_out_of_range_are_refused_in_one_line(stories_path, tmp_path, capsys):
    base = ["bench", "--model", str(stories_path), "--contexts", "", "--modes", "paged", "--json", str(tmp_path / "b.json")]
    for flags, words in ((["--prefix-cache", "-1"], "cannot be negative"),
                         (["--prefix-cache", "2", "--shared-prompt", "500"], "must be 1..472")):
        assert cli_main(base + flags) == 2
        err = capsys.readouterr().err
        said = [line for line in err.splitlines() if not line.startswith("note: ")]  # the memory verdict aside
        assert words in err and len(said) == 1 and "Traceback" not in err
    assert not (tmp_path / "b.json").exists()


def test_mixed_scenario_measures_a_chat_beside_decoding_streams(stories):
    import dataclasses

    from engine.tools import bench_scenarios as sc

    lm = dataclasses.replace(stories, arenas=None, model_runner=None)  # its own pages: none of other tests'
    m = sc.mixed(lm, chat_tokens=16, api_context=32, page_size=16, streams=2, repeats=2)
    assert m["streams_decoding"] == 2  # the chat's TTFT was measured while both streams decoded
    assert len(m["idle_runs_ms"]) == len(m["busy_runs_ms"]) == 2 and min(m["idle_runs_ms"]) > 0
    assert abs(m["busy_over_idle"] - m["busy_ttft_ms"] / m["idle_ttft_ms"]) < 0.01
    assert all(a.pool.num_used == 0 for a in lm.kv_arenas)  # every stream and chat closed: pages back
