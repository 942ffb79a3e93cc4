"""``python -m engine generate --messages FILE --json`` (#35 items 2, 3): each turn carries its prompt's cache
account, as the API's responses do, and a turn reuses the previous reply too (``ChatSession.start`` splices the
ids the cache was fed back into the rendered chat)."""

from __future__ import annotations

import json

from engine.tools.cli import main as cli_main


def test_each_turn_carries_its_account(stories_path, tmp_path, capsys):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"role": "user", "content": "Once upon a time there was a little girl named Lily."},
                                {"role": "user", "content": "What did she do?"},
                                {"role": "user", "content": "And then?"}]))
    rc = cli_main(["generate", "--model", str(stories_path), "--messages", str(path), "--json", "--max-new-tokens",
                   "40", "--temperature", "0", "--offline"])
    out = capsys.readouterr().out
    assert rc == 0
    turns = json.loads(out.strip().splitlines()[-1])["turns"]
    assert len(turns) == 3
    for i, t in enumerate(turns):
        acc = t["cache"]
        assert acc["reused"] == t["reused_tokens"] and acc["recomputed"] == t["recomputed_tokens"]
        assert acc["reused"] + acc["recomputed"] + acc["dropped"] == t["prompt_tokens"]
        at = acc["reused"] + acc["dropped"]
        for m in acc["misses"]:
            assert m["start"] == at < m["end"]
            at = m["end"]
        assert at == t["prompt_tokens"]
        if i:  # the previous prompt and its reply (but the reply's last token, never fed) are reused
            prev = turns[i - 1]
            assert acc["reused"] >= 0.95 * (prev["prompt_tokens"] + len(prev["token_ids"]))
            assert [m["reason"] for m in acc["misses"]] == ["new"]
