"""The self-test's speculative decoding check: the same chat's reply, plain greedy and then regenerated with prompt
lookup, must be the same tokens (speculation is exact), the second reply having verified draft tokens."""

from __future__ import annotations

from typing import Callable

from engine.config import CacheConfig, SpecConfig

Wait = Callable[[Callable[[], bool], float], bool]  # app.selftest.run.wait_until (passed in: no import cycle)

SPEC_PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat sat on the mat."
SPEC_TOKENS = 48


def speculate(t, cfg: SpecConfig, wait_until: Wait) -> bool:
    """Apply ``cfg`` as the Speculation tab does; True once the worker confirmed it."""
    t.window.speculation.apply(cfg)
    return wait_until(lambda: t.window.speculation.applied == cfg, 60)


def regenerate(t, wait_until: Wait) -> dict:
    """Regenerate the last reply (Ctrl+R) and wait for it; its stats."""
    w, done = t.window, []
    before = w.generation_id
    w.conversation.regenerate()
    if not wait_until(lambda: w.generation_id not in (0, before), 10):
        return dict(finished=False, reason="not sent")
    gen = w.generation_id
    w.reply_finished.connect(lambda g, reason: done.append(reason) if g == gen else None)
    wait_until(lambda: bool(done), 300)
    w.reply_finished.disconnect()
    return dict(w.last_stats, finished=bool(done), reason=done[0] if done else "timeout")


def check_speculative_reply(t, wait_until: Wait) -> None:
    """One reply with prompt lookup, token-identical to the plain greedy reply of the same chat (speculation never
    turns itself off here: the check is about the tokens, not the speed)."""
    w = t.window
    w.new_chat()
    t.apply(CacheConfig(mode="paged", page_size=16))
    t.sampling(SPEC_TOKENS)
    plain = t.reply(SPEC_PROMPT)
    plain_text = w.chat.bubbles[-1].text if w.chat.bubbles else ""
    on = speculate(t, SpecConfig(method="ngram", auto_off=False), wait_until)
    r = regenerate(t, wait_until) if on and t.finished_well(plain) else dict(finished=False, reason="not run")
    text = w.chat.bubbles[-1].text if w.chat.bubbles else ""
    t.check(on and t.finished_well(r) and text == plain_text and r.get("generated_tokens") == SPEC_TOKENS
            and r.get("speculative") == "ngram" and r.get("draft_tokens", 0) > 0,
            f"speculative reply (prompt lookup) identical to the plain greedy one: {r['reason']}, "
            f"{r.get('generated_tokens', 0)} tokens in {r.get('forwards', 0)} forwards, "
            f"{r.get('accepted_draft_tokens', 0)} of {r.get('draft_tokens', 0)} draft tokens kept, "
            f"{'same text' if text == plain_text else 'DIFFERENT text'}")
    t.check(speculate(t, SpecConfig(), wait_until), "speculative decoding off again")
