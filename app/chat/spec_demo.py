"""The empty chat's repeat starter shows speculative decoding at work with the built-in model.

stories260K repeats a repeated line only when it decodes greedily (at the default temperature 0.7 and repetition
penalty 1.1 it tells a story instead: prompt lookup kept 13 of 75 guesses), and speculation is off until chosen. So
the starter ("Tom has a big red ball… (prompt lookup)") sends its line with prompt lookup on — the Speculation tab's
setting, left on and said so — the accepted guesses tinted, and greedy sampling for that one reply (the Sampling tab
is not changed): greedy, 212 of 269 guesses kept, and the footer says how many.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from PySide6.QtCore import QObject

from engine.config import SpecConfig

NOTICE = ("Prompt lookup is on (Speculation tab: it guesses the next tokens from the chat, and the model checks them "
          "in one pass) and this reply is greedy (temperature 0, no repetition penalty; the Sampling tab is "
          "unchanged), so the model repeats the line: the tinted tokens are the guesses it kept, the footer counts "
          "them.")


class RepeatDemo(QObject):
    """Takes the chat pane's repeat starter (``repeat_requested``) in the window that owns ``conversation``."""

    def __init__(self, conversation: Any, pane: Any) -> None:
        super().__init__(conversation)
        self.conv, self.pane = conversation, pane
        self.window = conversation.parent()  # its speculation controller and sampling (made before the conversation)
        if getattr(self.window, "speculation", None) is None:
            return
        pane.repeat_demo = True
        pane.repeat_requested.connect(self.send)

    def send(self, prompt: str) -> None:
        w = self.window
        if w.speculation.requested.method == "off":
            w.speculation.apply(SpecConfig(method="ngram"))  # the worker applies it before the reply starts
        if not w.speculation.tint:
            w.speculation.set_tint(True)
        override = w.sampling_override
        w.sampling_override = replace(override or w.sampling.sampling(), temperature=0.0, repetition_penalty=1.0)
        try:
            self.conv.send(prompt)
        finally:
            w.sampling_override = override
        self.pane.notice.show_message(NOTICE, tone="info")
