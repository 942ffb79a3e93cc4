"""``python -m engine fidelity``, and a fidelity check's report: the rows, and the worst tokens placed in the chat.

    python -m engine fidelity --model DIR (--text FILE | --chat FILE.json) [cache flags] [--scope last-turn|chat]
        [--grid] --json OUT

writes ``{"model", "tokens", "scope", "scored_tokens", "dropped_tokens", "seconds", "reference": {...},
"setting": {... per-token "kl" and "agree"}, "worst": [...], "grid": [...]}``: the cache flags' setting against the
full-precision keep-everything cache, and with ``--grid`` every precision × policy (``fidelity.grid_settings``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Sequence

from engine.tools.fidelity import WORST, ChatText, FidelityCheck, FidelityRow, chat_text, grid_settings, describe


def token_places(tokenizer, messages: Sequence[dict], chat: ChatText, positions: Sequence[int]) -> dict[int, tuple]:
    """Where tokens lie in the messages' own text: position → (message index, first char, end char) of its content,
    for the ``positions`` inside a message whose decoded tokens contain its text (template markers around it are
    found by the decoded text; a token that is all template has no place)."""
    from engine.model.chat import StreamDecoder

    out: dict[int, tuple] = {}
    wanted = sorted(set(int(p) for p in positions))
    for i, (a, b) in enumerate(chat.spans):
        inside = [p for p in wanted if a <= p < b]
        if not inside or i >= len(messages):
            continue
        d, ends = StreamDecoder(tokenizer), []
        for t in chat.ids[max(a, 0):b]:
            d.push(t)
            ends.append(len(d.text))
        d.flush()
        content = str(messages[i].get("content", ""))
        at = d.text.find(content) if content else -1
        if at < 0:
            continue
        for p in inside:
            k = p - max(a, 0)
            s, e = (ends[k - 1] if k > 0 else 0) - at, ends[k] - at
            s, e = max(0, s), min(len(content), e)
            if e > s:
                out[p] = (i, s, e)
    return out


def worst_tokens(lm, chat: ChatText, row: FidelityRow, messages: Sequence[dict] | None,
                 n: int = WORST) -> list[dict[str, Any]]:
    """The ``n`` scored tokens with the largest KL, largest first: position, token text, KL, whether the top-1
    agreed, and where they lie in the messages (``message``, ``chars``; -1 / None in a plain text)."""
    if not row.kl:
        return []
    order = sorted(range(len(row.kl)), key=lambda i: -row.kl[i])[:n]
    positions = [chat.start + i for i in order]
    places = token_places(lm.tokenizer, messages, chat, positions) if messages else {}
    out = []
    for i, p in zip(order, positions):
        message, s, e = places.get(p, (-1, 0, 0))
        out.append({"position": p + chat.dropped, "token_id": chat.ids[p], "text": lm.tokenizer.decode([chat.ids[p]]),
                    "kl": row.kl[i], "agree": row.agree[i], "message": message,
                    "chars": [s, e] if message >= 0 else None})
    return out


def report(lm, check: FidelityCheck, messages: Sequence[dict] | None, scope: str, seconds: float) -> dict[str, Any]:
    """The JSON-friendly report of a finished (or stopped) check: the reference, the first setting with its
    per-token KL and worst tokens, and every other setting's row (the grid)."""
    rows, chat = check.rows, check.chat
    ref = rows[0] if rows else None
    setting = rows[1] if len(rows) > 1 else None
    return {
        "tokens": len(chat.ids) + chat.dropped, "scope": scope, "scored_tokens": chat.scored,
        "dropped_tokens": chat.dropped, "seconds": round(seconds, 3), "cancelled": check.cancelled,
        "reference": ref.as_dict() if ref is not None else None,
        "setting": setting.as_dict(per_token=True) if setting is not None else None,
        "worst": worst_tokens(lm, chat, setting, messages) if setting is not None else [],
        "grid": [r.as_dict() for r in rows[2:]],
    }


def run_check(lm, check: FidelityCheck, on_row: Callable[[FidelityRow], None] | None = None) -> list[FidelityRow]:
    """Run ``check`` to its end as a task of an engine core of its own (as the app's worker runs it); an exception
    that ended it is raised."""
    from engine.core.scheduler import EngineCore, Task

    failed: list[BaseException] = []
    core = EngineCore(lm)
    core.add_task(Task(check, lambda row: on_row(row) if row is not None and on_row is not None else None,
                       failed.append))
    try:
        while core.busy:
            core.round()
            if failed:
                raise failed[0]
    finally:
        check.close()
    return check.rows


def add_parser(sub, cache_args: Callable, model_args: Callable) -> None:
    """The ``fidelity`` subcommand (``engine.tools.cli`` calls it with its cache and model flag builders)."""
    f = sub.add_parser("fidelity", help="what the cache setting costs on your own chat or text: per-token KL, top-1, "
                                        "perplexity against the full-precision keep-everything cache")
    f.add_argument("--model", required=True, help="folder, hub id, or demo")
    src = f.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="UTF-8 text file")
    src.add_argument("--chat", help="JSON file: a list of {role, content} (a saved chat, its replies included)")
    f.add_argument("--scope", default="last-turn", choices=("last-turn", "chat"),
                   help="score the last turn (from the last user message) or the whole chat (default last-turn)")
    f.add_argument("--grid", action="store_true", help="also every K/V precision × eviction policy (half the chat)")
    cache_args(f)
    model_args(f)
    f.add_argument("--json", dest="json_file", required=True, help="output file")


def _read_chat(path: str) -> list[dict]:
    """``--chat FILE``: a saved chat, its replies included (checked as the API checks messages)."""
    from engine.model.chat import validate_messages
    from engine.tools.arguments import MESSAGES_HINT
    from engine.inputs import read_json

    return validate_messages(read_json(path, "chat file", hint=MESSAGES_HINT), for_reply=False)


def run_fidelity(a, cache_config: Callable, model_spec: Callable) -> int:
    """The ``fidelity`` command (``cache_config`` / ``model_spec``: the CLI's readers of its flags): every input
    checked before the model loads."""
    from engine.tools.arguments import check_output_path, write_json
    from engine.inputs import read_text

    check_output_path(a.json_file)
    cfg = cache_config(a)
    messages = _read_chat(a.chat) if a.chat else None
    text = read_text(a.text, "--text file", hint="give a UTF-8 text file") if a.text else None
    import torch

    from engine.model.loader import load_model
    from engine.model.notes import print_notes

    lm = load_model(model_spec(a), print_notes)  # the memory verdict, on stderr
    torch.set_grad_enabled(False)
    chat = chat_text(lm, messages, text, a.scope)
    settings = [(describe(cfg), cfg)] + (grid_settings(cfg, len(chat.ids)) if a.grid else [])
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    if chat.dropped:
        log(f"the chat's first {chat.dropped:,} tokens were left out: the model's context is "
            f"{lm.info.context_length:,}")
    t0 = time.perf_counter()
    check = FidelityCheck(lm, chat, settings)
    run_check(lm, check, lambda r: log(_line(r)))
    out = report(lm, check, messages, a.scope, time.perf_counter() - t0)
    out["model"] = a.model
    write_json(a.json_file, out)
    return 0


def _line(r: FidelityRow) -> str:
    if r.error:
        return f"{r.label:34s} error: {r.error}"
    return (f"{r.label:34s} KL {r.mean_kl:.5f} (max {r.max_kl:.3f})  top-1 {100 * r.top1_agreement:6.2f}%  ppl "
            f"{r.perplexity:8.3f} (×{r.perplexity_ratio:.4f})  {r.bytes_per_token:8.1f} B/token  {r.seconds:.2f} s")
