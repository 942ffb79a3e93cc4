"""``generate --speculative`` and ``bench --speculative ... --scenario copy`` through the real CLI on stories260K."""

from __future__ import annotations

import json

import pytest

from engine.tools.cli import main as cli_main

PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside. Once upon a time, "
          "there was a little girl named Lily.")


def _generate(stories_path, capsys, *extra) -> dict:
    rc = cli_main(["generate", "--model", str(stories_path), "--prompt", PROMPT, "--max-new-tokens", "60",
                   "--ignore-eos", "--json", *extra])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


def test_generate_speculative_gives_the_same_tokens_and_counts_them(stories_path, capsys):
    plain = _generate(stories_path, capsys)
    assert plain["speculative"] is None and plain["draft_tokens"] == 0 and plain["forwards"] == 60
    for flags, label in ((["--speculative", "ngram", "--draft-tokens", "4"], "ngram"),
                         (["--speculative", f"draft:{stories_path}"], f"draft:{stories_path}")):
        spec = _generate(stories_path, capsys, *flags)
        assert spec["token_ids"] == plain["token_ids"] and spec["speculative"] == label
        assert spec["forwards"] == 60 - spec["accepted_draft_tokens"] and spec["accepted_draft_tokens"] > 0
        assert sum(spec["accepted_by_position"]) == spec["accepted_draft_tokens"]
    assert spec["accepted_draft_tokens"] == spec["draft_tokens"]  # the model drafting for itself: all kept


def test_generate_seeded_sampling_with_speculation_repeats_and_is_the_plain_reply(stories_path, capsys):
    """``--speculative ngram --temperature 0.8 --seed 11`` twice (auto-off on, as the CLI has it: whether
    speculation goes on is measured on the clock), and once without speculation: the same 60 tokens."""
    seeded = ["--temperature", "0.8", "--seed", "11"]
    plain = _generate(stories_path, capsys, *seeded)
    runs = [_generate(stories_path, capsys, *seeded, "--speculative", "ngram") for _ in range(2)]
    assert runs[0]["draft_tokens"] > 0  # speculation ran in the first reply (a new model: no verdict yet)
    assert [r["token_ids"] for r in runs] == [plain["token_ids"]] * 2


@pytest.mark.parametrize("value,error", [("beam", "is not one of off, ngram, draft"), ("draft:", "needs its path"),
                                         ("draft:demo", "tokenizer differs")])
def test_generate_refuses_a_bad_speculative_flag(stories_path, capsys, value, error):
    rc = cli_main(["generate", "--model", str(stories_path), "--prompt", "Hi", "--speculative", value])
    assert rc == 2 and error in capsys.readouterr().err


def test_bench_pairs_each_row_with_its_speculative_twin(stories_path, tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = cli_main(["bench", "--model", str(stories_path), "--contexts", "32", "--modes", "hf-dynamic,paged",
                   "--new-tokens", "48", "--speculative", "ngram", "--scenario", "copy", "--eager",
                   "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    for kind in ("", "copy"):
        mine = [r for r in rows if r.get("kind", "") == kind]
        assert [(r["engine"], r["mode"], r.get("speculative")) for r in mine] == [
            ("hf", "dynamic", None), ("kvscope", "paged", None), ("kvscope", "paged", "ngram")]
        spec = mine[2]
        assert spec["forwards"] == 48 - spec["accepted_draft_tokens"] and spec["decode_tokens_per_s"] > 0
    copy = [r for r in rows if r.get("kind") == "copy"][2]
    assert copy["accepted_draft_tokens"] > 0 and copy["tokens_per_forward"] > 1  # the passage repeats
    assert "paged+spec" in capsys.readouterr().err


def test_a_missing_or_broken_draft_model_is_named_before_or_after_the_main_one(stories_path, tmp_path, capsys):
    """A draft folder that does not exist is refused before the main model loads; one that cannot be loaded is
    refused naming the draft model (the main one loaded fine)."""
    import time

    from engine.tools.cli import main as cli_main

    t = time.perf_counter()
    rc = cli_main(["generate", "--model", str(stories_path), "--prompt", "Once", "--speculative",
                   f"draft:{tmp_path / 'nope'}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"draft model {tmp_path / 'nope'}: no such folder" in err and err.count("\n") == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    rc = cli_main(["generate", "--model", str(stories_path), "--prompt", "Once", "--speculative", f"draft:{empty}"])
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if not line.startswith("note: ")]  # the main model's memory verdict
    assert rc == 2 and f"draft model {empty}:" in err and len(said) == 1
