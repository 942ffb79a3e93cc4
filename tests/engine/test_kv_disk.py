"""The KV disk tier (``engine.kv.tier.disk``): a chat's full pages written to files and restored by a later model load
(a new process, or here a fresh load: its memory holds none of them) — restore equals recompute, other models
and settings never reuse a page, the byte budget evicts least recently used files, damaged / missing files are
dropped and recomputed with a note, a folder that cannot be written is a note, and a process killed with
SIGKILL while writing leaves only complete files that a restart restores. Real files in ``tmp_path``, real
subprocesses; no mocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.model.chat import encode_prompt
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.kv.tier import disk
from engine.kv.tier.fingerprint import model_fingerprint
from engine.kv.paged.prefix import ROOT, extend_chain
from engine.model.loader import load_model
from engine.core.session import ChatSession

from tests.engine.test_exact import hf_greedy

P = 16
IDS = [5 + (i * 37) % 400 for i in range(200)]  # 200 tokens: 12 pages restorable (one token is left to prefill)
ROOT_DIR = Path(__file__).resolve().parents[2]


def chat(lm, ids, n=12, cache: CacheConfig | None = None):
    """Greedy reply of ``n`` tokens to ``ids``: (tokens, its last stats, its notes)."""
    s = ChatSession(lm, cache or CacheConfig(page_size=P))
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    out = s.generated_ids
    s.close()
    return out, r.stats, r.warnings


@pytest.fixture
def fresh(stories_path):
    """Fresh loads of stories260K (no page of an earlier load in memory); their tiers closed afterwards."""
    loaded = []

    def load(folder=None, spec=None, budget=disk.DEFAULT_BUDGET):
        lm = load_model(spec or str(stories_path))
        if folder is not None:
            disk.configure(lm, str(folder), budget)
        loaded.append(lm)
        return lm

    yield load
    for lm in loaded:
        disk.configure(lm, None)


def page_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kvp"))


def chain_files(lm, folder: Path, ids, pages: int) -> list[Path]:
    """The files that name pages ``0 .. pages-1`` of ``ids`` on ``lm``'s shelf."""
    shelf = Path(lm.kv_arenas.disk.shelf(lm.kv_arenas.get(P, None, "auto", "auto")))
    return [shelf / (h.hex() + disk.SUFFIX) for h in extend_chain([], ids, P, pages, ROOT)]


def test_restore_equals_recompute_and_hf(fresh, tmp_path):
    lm = fresh(tmp_path)
    first, st, _ = chat(lm, IDS)
    lm.kv_arenas.disk.flush()
    assert st.disk_restored_tokens == 0 and len(page_files(tmp_path)) == (200 + 11) // P  # 13 full pages written
    again = fresh(tmp_path)
    second, st2, notes = chat(again, IDS)
    assert st2.disk_restored_tokens == 192 and st2.shared_tokens == 192 and st2.recomputed_tokens == 8
    assert any(n.startswith("restored 192 tokens from disk in ") for n in notes)
    assert second == first == hf_greedy(again, IDS, 12)
    again.kv_arenas.drop_idle()  # memory forgets the pages (as a restart would)
    s = ChatSession(again, CacheConfig(page_size=P))  # the page map's "restored from disk" pages: the chat's first 12
    s.start_ids(IDS, SamplingConfig(max_new_tokens=2))
    snapshot = s.step().snapshot
    assert snapshot.restored_pages == tuple(s.store.table.pages[:12]) and len(set(snapshot.restored_pages)) == 12
    s.close()
    off, st3, _ = chat(fresh(), IDS)  # no tier: prefilled
    assert off == first and st3.disk_restored_tokens == 0
    stats = again.kv_arenas.disk.stats()
    assert stats["hit_tokens"] == 2 * 192 and stats["bytes_read"] == 24 * again.kv_arenas.get(P, None, "auto", "auto").page_bytes


def test_other_models_and_settings_never_reuse(fresh, tmp_path, stories_path):
    first = fresh(tmp_path)
    chat(first, IDS)
    first.kv_arenas.disk.flush()
    fresh_lm = fresh(tmp_path)
    for cache in (CacheConfig(page_size=8), CacheConfig(page_size=P, k_dtype="int8", v_dtype="int8")):
        _, st, _ = chat(fresh_lm, IDS, cache=cache)
        assert st.disk_restored_tokens == 0
    fresh_lm.kv_arenas.disk.flush()
    assert len({p.parent for p in page_files(tmp_path)}) == 2  # page size 8: a shelf of its own; int8: none
    half = fresh(tmp_path, ModelSpec(source=str(stories_path), dtype="bfloat16"))
    _, st, _ = chat(half, IDS)
    assert st.disk_restored_tokens == 0
    assert chat(fresh(tmp_path, "demo"), [i % 200 for i in IDS])[1].disk_restored_tokens == 0
    # one weight changed in its last bits: another fingerprint (a fine-tune never reads its base's pages)
    tuned = fresh()
    base_fp = model_fingerprint(tuned)
    with torch.no_grad():
        w = next(p for n, p in tuned.model.named_parameters() if n.endswith("q_proj.weight"))
        w.view(-1)[w.numel() // 2] = torch.nextafter(w.view(-1)[w.numel() // 2], torch.tensor(9.0))
    assert model_fingerprint(tuned) != base_fp
    disk.configure(tuned, str(tmp_path))
    assert chat(tuned, IDS)[1].disk_restored_tokens == 0


def test_budget_evicts_least_recently_used_files(fresh, tmp_path):
    a, b, c = ([base + i for i in range(41)] for base in (10, 100, 200))  # 2 full pages each (1 token generated)
    probe = fresh(tmp_path / "probe")
    chat(probe, a, n=1)
    probe.kv_arenas.disk.flush()
    size = probe.kv_arenas.disk.nbytes // 2
    folder = tmp_path / "tier"
    lm = fresh(folder, budget=4 * size)
    chat(lm, a, n=1)
    chat(lm, b, n=1)
    lm.kv_arenas.disk.flush()
    assert lm.kv_arenas.disk.stats()["files"] == len(page_files(folder)) == 4
    reader = fresh(folder, budget=4 * size)
    assert chat(reader, a, n=1)[1].disk_restored_tokens == 32  # a read: a's files are now the most recent
    chat(reader, c, n=1)  # two more files: b's two (least recently used) go
    reader.kv_arenas.disk.flush()
    assert reader.kv_arenas.disk.stats()["evicted_files"] == 2 and len(page_files(folder)) == 4
    last = fresh(folder, budget=4 * size)
    assert [chat(last, x, n=1)[1].disk_restored_tokens for x in (a, c, b)] == [32, 32, 0]


def test_pages_past_the_writers_queue_are_skipped_not_waited_for(fresh, tmp_path):
    lm = fresh(tmp_path)
    tier = lm.kv_arenas.disk
    tier.max_pending = 5 * lm.kv_arenas.get(P, None, "auto", "auto").page_bytes  # room for 5 pages queued
    want, _, _ = chat(lm, IDS)  # the prefill names 12 pages at once: 5 queued, 7 skipped
    tier.flush()
    assert tier.stats()["skipped_pages"] >= 7
    got, st, _ = chat(fresh(tmp_path), IDS)
    assert st.disk_restored_tokens == 5 * P and got == want  # the chain's first 5 pages, then a gap: prefilled


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "renamed", "missing"])
def test_damaged_or_missing_files_are_dropped_and_recomputed(fresh, tmp_path, damage):
    lm = fresh(tmp_path)
    want, _, _ = chat(lm, IDS)
    lm.kv_arenas.disk.flush()
    files = chain_files(lm, tmp_path, IDS, 12)
    bad = files[5]
    raw = bad.read_bytes()
    if damage == "flip":
        bad.write_bytes(raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:])
    elif damage == "truncate":
        bad.write_bytes(raw[:len(raw) // 2])
    elif damage == "garbage":
        bad.write_bytes(b"\0" * len(raw))
    elif damage == "renamed":  # another page's whole, valid file under this page's name
        bad.write_bytes(files[6].read_bytes())
    else:
        bad.unlink()
    again = fresh(tmp_path)
    got, st, notes = chat(again, IDS)
    assert got == want and st.disk_restored_tokens == 5 * P  # pages 0-4; page 5 and the rest are prefilled
    assert again.kv_arenas.disk.stats()["dropped_files"] == (damage != "missing")  # then written again, whole
    why = {"flip": "checksum mismatch", "truncate": "truncated", "garbage": "not a page file",
           "renamed": "name does not match"}.get(damage)
    dropped = [n for n in notes if "dropped a page file" in n]
    assert (len(dropped) == 1 and why in dropped[0]) if why else not dropped
    again.kv_arenas.disk.flush()  # the recomputed page is written again: the next load restores all 12
    assert chat(fresh(tmp_path), IDS)[1].disk_restored_tokens == 12 * P


def test_a_folder_that_cannot_be_written_is_a_note_not_a_crash(fresh, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    lm = fresh(blocker / "kv")  # makedirs fails (a file is in the way), as for a read-only or missing mount
    tokens, st, notes = chat(lm, IDS)
    assert any("KV disk tier: cannot write to" in n for n in notes)
    assert tokens == chat(fresh(), IDS)[0] and not lm.kv_arenas.disk.writable
    # a folder that stops taking writes later (here: a file where the shelf folder goes): writes stop, a note
    ok = fresh(tmp_path / "ok")
    shelf = Path(ok.kv_arenas.disk.shelf(ok.kv_arenas.get(P, None, "auto", "auto")))
    shelf.parent.mkdir(exist_ok=True)
    shelf.write_text("in the way")
    notes = chat(ok, IDS)[2]
    ok.kv_arenas.disk.flush()
    assert not ok.kv_arenas.disk.writable and ok.kv_arenas.disk.stats()["pages_written"] == 0
    assert any("pages are no longer saved" in n for n in [*notes, *ok.kv_arenas.disk.take_notes()])
    if os.geteuid() != 0:  # permissions bind only a user that is not root
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        assert chat(fresh(ro), IDS)[0] == tokens


def _generate(model: Path, prompt: str, folder: Path, n: int) -> list[str]:
    return [sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt", prompt, "--json",
            "--kv-disk", str(folder), "--max-new-tokens", str(n), "--ignore-eos", "--page-size", str(P)]


def test_kill_during_writes_then_restart_restores_complete_files(fresh, stories_path, tmp_path):
    stories = fresh()  # a fresh load: the session's shared model may carry other tests' changes (its fingerprint)
    prompt = "Once upon a time, there was a little girl named Lily. She liked to play outside in the sun. " * 4
    ids = encode_prompt(stories.tokenizer, prompt)
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR), "KVSCOPE_FAST_STEP": "off"}
    folder = tmp_path / "kv"
    proc = subprocess.Popen(_generate(stories_path, prompt, folder, 300), cwd=ROOT_DIR, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and len(list(folder.glob("*/*"))) < 3:
            time.sleep(0.002)  # kill as soon as the writer is at work (a page every 16 tokens while decoding)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    tier = disk.configure(stories, str(folder))  # parses every page file it restores: complete ones only
    try:
        arena = stories.kv_arenas.get(P, None, "auto", "auto")
        names = extend_chain([], ids, P, (len(ids) - 1) // P, ROOT)
        present = 0
        for h in names:  # every page file left is complete (checksum good), or missing: never torn
            if tier.get(arena, h) is None:
                break
            present += 1
        assert tier.stats()["dropped_files"] == 0
    finally:
        disk.configure(stories, None)
    out = subprocess.run(_generate(stories_path, prompt, folder, 20), cwd=ROOT_DIR, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    turn = json.loads(out.stdout)
    assert turn["disk_restored_tokens"] == present * P
    assert turn["token_ids"] == chat(stories, ids, n=20)[0]  # as a run without the tier
    out = subprocess.run(_generate(stories_path, prompt, folder, 20), cwd=ROOT_DIR, env=env, capture_output=True,
                         text=True, timeout=300)
    assert json.loads(out.stdout)["disk_restored_tokens"] == len(names) * P
    assert json.loads(out.stdout)["token_ids"] == turn["token_ids"]


def test_server_counts_disk_hits_in_usage_and_metrics(fresh, tmp_path):
    import httpx

    from engine.server import KVServer, ServerOptions, ServerThread
    from engine.server.metrics import parse as parse_metrics

    story = "Once upon a time, there was a little girl named Lily. She liked to play outside. " * 3
    results = []
    for _ in range(2):  # two servers, one after the other, on fresh loads: the second finds the pages on disk
        lm = fresh(tmp_path)
        server = KVServer(lm, CacheConfig(page_size=P), ServerOptions())
        thread = ServerThread(server)
        url = thread.start()
        try:
            body = {"model": server.model_id, "messages": [{"role": "user", "content": story}], "max_tokens": 8,
                    "temperature": 0}
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
            lm.kv_arenas.disk.flush()
            results.append((reply, parse_metrics(httpx.get(url + "/metrics", timeout=120).text)))
        finally:
            thread.stop()
    (r1, m1), (r2, m2) = results
    assert r1["choices"][0]["message"] == r2["choices"][0]["message"]
    prompt = r2["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // P * P > 0
    assert m2["kvscope_kv_disk_hits_total"] == (prompt - 1) // P * P and m1["kvscope_kv_disk_hits_total"] == 0
    assert m1["kvscope_kv_disk_written_bytes_total"] > 0 and m1["kvscope_kv_disk_misses_total"] == (prompt - 1) // P * P
    assert m2["kvscope_kv_disk_bytes"] == m1["kvscope_kv_disk_bytes"] > 0


def test_generate_messages_reports_disk_restored_tokens_per_turn(stories_path, tmp_path):
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Lily had a red ball. She played in the park. " * 3},
                                {"role": "user", "content": "Then what happened to the ball?"}]))
    cmd = [sys.executable, "-m", "engine", "generate", "--model", str(stories_path), "--messages", str(msgs), "--json",
           "--kv-disk", str(tmp_path / "kv"), "--max-new-tokens", "12", "--page-size", str(P)]
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR), "KVSCOPE_FAST_STEP": "off"}
    runs = []
    for _ in range(2):  # the second process finds the first's pages on disk
        out = subprocess.run(cmd, cwd=ROOT_DIR, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout)["turns"])
    first, second = runs
    assert [t["disk_restored_tokens"] for t in first] == [0, 0]  # turn 2 reuses turn 1's pages from memory
    restored = (second[0]["prompt_tokens"] - 1) // P * P
    assert second[0]["disk_restored_tokens"] == restored > 0 and second[0]["reused_tokens"] == restored
    # turn 2: its first tokens are the chat's own cache (memory); the pages turn 2 computed in the first process
    # (the reply, the new question) come from disk, the partly filled page where the own cache ends among them
    d = second[1]["disk_restored_tokens"]
    assert d % P == 0 and P > d - (first[1]["recomputed_tokens"] - second[1]["recomputed_tokens"]) >= 0
    assert second[1]["recomputed_tokens"] < first[1]["recomputed_tokens"]
    assert [t["token_ids"] for t in second] == [t["token_ids"] for t in first]


def test_budget_flag_sets_the_limit_and_refuses_nonsense(stories, stories_path, tmp_path, capsys):
    from argparse import Namespace

    from engine.tools.cli import main

    tier = disk.configure_flag(stories, Namespace(kv_disk=str(tmp_path), kv_disk_budget=0.5))
    try:
        assert tier.budget == 1 << 29 and stories.kv_arenas.disk is tier
    finally:
        disk.configure(stories, None)
    assert disk.configure_flag(stories, Namespace(kv_disk="off", kv_disk_budget=None)) is None
    code = main(["generate", "--model", str(stories_path), "--prompt", "Once", "--kv-disk", str(tmp_path),
                 "--kv-disk-budget", "0"])
    assert code == 2 and "--kv-disk-budget 0.0: give more than 0 GiB" in capsys.readouterr().err


def test_bench_reopen_scenario_rows(stories_path, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "engine", "bench", "--model", str(stories_path), "--scenario", "reopen", "--contexts",
           "200", "--new-tokens", "8", "--eager", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR), "KVSCOPE_FAST_STEP": "off"}
    run = subprocess.run(cmd, cwd=ROOT_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [r for r in json.loads(out.read_text())["rows"] if r.get("scenario") == "reopen"]
    by = {r.get("restore") or "writer " + r["writer"]: r for r in rows}
    assert set(by) == {"disk", "prefill", "writer on", "writer off"}
    assert by["disk"]["disk_restored_tokens"] == 192 and by["disk"]["recomputed_tokens"] == 8
    assert by["prefill"]["disk_restored_tokens"] == 0 and by["prefill"]["recomputed_tokens"] == 200
    assert by["disk"]["first_token"] == by["prefill"]["first_token"]  # a new process: the same first token
    assert by["disk"]["ttft_ms"] > 0 and by["writer on"]["decode_tokens_per_s"] > 0
