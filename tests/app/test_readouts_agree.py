"""Every readout describes the same snapshot of the chat on screen, with one definition each (#19 item 9):
'Context used' (status bar) = 'tokens cached' (Layer occupancy) + the one just generated, never above the
model's context; 'tokens in the chat' counts dropped ones too and is shown under its own name. Real window, real
stories260K (512 context) with H2O and with StreamingLLM past the context."""

from __future__ import annotations

import re

import pytest
from app_helpers import close_window, open_window, wait_reply

from engine.config import CacheConfig, SamplingConfig
from engine.policies.base import config_from_flags


POLICIES = {"h2o": {"budget": 96, "window": 32}, "streaming": {"sinks": 4, "window": 120}}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_context_used_is_what_the_cache_holds_and_the_chat_is_named_apart(qtbot, data_dir, stories_path, policy):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=560, ignore_eos=True))
    try:
        cfg = config_from_flags(policy=policy, flags=POLICIES[policy], mode="paged", page_size=16)
        with qtbot.waitSignal(w.engine.worker.applied, timeout=30_000):
            w.apply_cache_config(cfg)
        w.send("Once upon a time")
        wait_reply(qtbot, w, 120_000)
        qtbot.wait(400)  # the panels' last frame
        snap = w.occupancy.last_snapshot
        cached = int(max(snap.tokens_per_layer))
        status = w.status.context.text()
        used, total = (int(x.replace(",", "")) for x in re.match(r"Context: ([\d,]+) of ([\d,]+)", status).groups())
        assert total == 512 and used <= total  # was 'Context: 531 of 512'
        assert f"{cached} tokens cached" in w.occupancy.caption.text()
        assert used - cached in (0, 1)  # the token just generated, fed by the next step
        chat = int(re.search(r"chat ([\d,]+)", status).group(1).replace(",", ""))
        dropped = int(re.search(r"\(([\d,]+) dropped\)", status).group(1).replace(",", ""))
        assert chat == snap.seq_len > total and dropped == chat - used
        # the occupancy's evicted are the status bar's dropped (H2O evicts each layer's own tokens: it said 118
        # evicted beside 176 dropped); those no layer holds, the strip's red, are named apart where fewer
        caption = w.occupancy.caption.text()
        evicted = int(re.search(r"· ([\d,]+) evicted", caption).group(1).replace(",", ""))
        assert evicted == dropped, (caption, status)
        everywhere = re.search(r"\(([\d,]+) from every layer\)", caption)
        assert int(everywhere.group(1).replace(",", "")) == snap.evicted_total < evicted if everywhere else \
            snap.evicted_total == evicted
        assert f"{snap.evicted_total:,} tokens evicted" in w.page_map.caption.text()
        tip = w.status.context.toolTip()
        assert "Context used" in tip and "Tokens in the chat" in tip and "tokens cached" in tip
    finally:
        close_window(w)
