"""Fidelity on the user's chat (``engine.tools.fidelity``): lossless settings give KL exactly 0; the chunked teacher
forcing equals decoding one token a time; the worst tokens are placed in their messages' text; the check runs as
steps and stops when cancelled; ``python -m engine fidelity`` writes the report and refuses bad input in one line."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import CacheConfig
from engine.core.session import ChatSession
from engine.core.teacher import teacher_force_chunks
from engine.tools.cli import main
from engine.tools.fidelity import FidelityCheck, chat_text, describe, grid_settings
from engine.tools.fidelity_report import report, run_check
from engine.tools.quality import DEFAULT_TEXT

CHAT = [{"role": "system", "content": "You are a storyteller."},
        {"role": "user", "content": "Tell me a story about Lily and her ball."},
        {"role": "assistant", "content": DEFAULT_TEXT[:420]},
        {"role": "user", "content": "What happened next?"},
        {"role": "assistant", "content": DEFAULT_TEXT[420:900]}]


@pytest.fixture(scope="module")
def chat(stories):
    return chat_text(stories, CHAT, scope="last-turn")


def _run(lm, chat, *settings):
    check = FidelityCheck(lm, chat, [(describe(c), c) for c in settings])
    run_check(lm, check)
    return check


def test_lossless_settings_give_exactly_zero_kl(stories, chat):
    lossless = [CacheConfig(), CacheConfig(page_size=1), CacheConfig(mode="contiguous"),
                CacheConfig(policy="expected", policy_params={"budget": 500, "recent": 16})]
    rows = _run(stories, chat, *lossless).rows
    assert [r.label for r in rows[1:]] == [describe(c) for c in lossless] and rows[0].label == "reference"
    for r in rows:
        assert not r.error and r.tokens == chat.scored > 100
        assert r.mean_kl == 0.0 and r.max_kl == 0.0 and set(r.kl) == {0.0}  # bit for bit the reference's logits
        assert r.top1_agreement == 1.0 and r.perplexity_ratio == 1.0


def test_a_lossy_setting_names_its_cost_and_its_worst_tokens_in_the_messages(stories, chat):
    check = _run(stories, chat, CacheConfig(k_dtype="int4", v_dtype="int4"))
    ref, row = check.rows
    assert row.mean_kl > 0 and len(row.kl) == chat.scored and row.mean_kl == pytest.approx(sum(row.kl) / len(row.kl))
    assert row.bytes_per_token < 0.4 * ref.bytes_per_token  # int4 codes against float32 pages
    out = report(stories, check, CHAT, "last-turn", 1.0)
    worst = out["worst"]
    assert len(worst) == 10 and [w["kl"] for w in worst] == sorted(row.kl, reverse=True)[:10]
    placed = [w for w in worst if w["message"] >= 0]  # the rest: the template's own tokens ("assistant:")
    assert len(placed) >= 7 and all(w["chars"] is None for w in worst if w["message"] < 0)
    for w in placed:  # the last turn: the last question and its reply; each token's own text where it lies
        assert w["message"] in (3, 4) and w["position"] >= chat.start
        a, b = w["chars"]
        assert CHAT[w["message"]]["content"][a:b].strip() == w["text"].strip()
    assert out["setting"]["kl"] == list(row.kl) and out["scored_tokens"] == chat.scored


@pytest.mark.parametrize("cfg", [CacheConfig(k_dtype="int8", v_dtype="int8"),
                                 CacheConfig(policy="h2o", policy_params={"budget": 96, "recent": 24}),
                                 CacheConfig(policy="expected", policy_params={"budget": 96, "recent": 16}),
                                 CacheConfig(policy="streaming", policy_params={"sinks": 4, "window": 92})],
                         ids=["int8", "h2o", "expected", "streaming"])
def test_chunked_teacher_forcing_is_what_decoding_one_token_a_time_sees(stories, chat, cfg):
    ids = list(chat.ids[:300])
    s = ChatSession(stories, cfg.replace(prefix_reuse=False))
    one = torch.stack([lg.float() for lg in s.teacher_force(ids)])  # [T, V]
    rows = list(teacher_force_chunks(s, ids))
    chunked = torch.cat([lg.float() for _, lg in rows])
    s.close()
    assert len(rows) < len(ids) / 3  # far fewer forwards
    diff = (one - chunked).abs()
    assert (one.argmax(-1) == chunked.argmax(-1)).all()
    # float rounding only: a code of an int8 page that rounds the other way moves a logit by ~0.01 (chunks of a
    # whole 64 tokens, where tokens read their own page quantized: max 0.18, mean 1.5e-2)
    assert diff.mean() < 1e-3 and diff.max() < (0.05 if cfg.quantized else 1e-3)


def test_the_check_runs_as_steps_and_stops_when_cancelled(stories, chat):
    check = FidelityCheck(stories, chat, grid_settings(CacheConfig(), len(chat.ids)))
    assert len(check.settings) == 1 + len(grid_settings(CacheConfig(), len(chat.ids)))
    while len(check.rows) < 2:
        check.step()
    fraction, _, doing = check.progress()
    assert 0 < fraction < 1 and f"of {len(check.settings)})" in doing
    check.cancel()
    assert check.done and check.cancelled and check.step() is None and len(check.rows) == 2


def test_the_grid_is_every_precision_by_every_policy_at_half_the_chat():
    from engine.config import KV_DTYPES
    from engine.policies import registry

    grid = grid_settings(CacheConfig(page_size=8), 400)
    assert {(c.k_dtype, c.policy) for _, c in grid} == {(k, p) for k in KV_DTYPES for p in ("none", *registry)}
    assert all(c.page_size == 8 and c.k_dtype == c.v_dtype for _, c in grid)
    assert {c.policy_params.get("budget") for _, c in grid if c.policy in ("h2o", "expected")} == {200}


def test_cli_writes_the_report_and_refuses_bad_input_in_one_line(stories_path, tmp_path, capsys):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps(CHAT))
    out = tmp_path / "f.json"
    assert main(["fidelity", "--model", str(stories_path), "--chat", str(chat), "--kv-dtype", "int8",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["setting"]["label"] == "int8" and data["reference"]["mean_kl"] == 0.0
    assert data["scope"] == "last-turn" and len(data["setting"]["kl"]) == data["scored_tokens"] > 100
    text = tmp_path / "t.txt"
    text.write_text(DEFAULT_TEXT[:500])
    assert main(["fidelity", "--model", str(stories_path), "--text", str(text), "--scope", "chat",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["setting"]["mean_kl"] == 0.0 and data["worst"][0]["message"] == -1  # lossless; a text has no messages
    capsys.readouterr()
    for argv, says in ((["--chat", str(tmp_path / "missing.json")], "chat file"),
                       (["--chat", str(text)], "chat file"),
                       (["--text", "/dev/zero"], "--text file")):
        assert main(["fidelity", "--model", str(stories_path), *argv, "--json", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and says in err and "\n" not in err
