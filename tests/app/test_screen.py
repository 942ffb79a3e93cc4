"""The chat on screen as a state machine: whatever the user switches to (a local chat, an API conversation, a
remote chat) and does (send, stop, regenerate, edit, pin, a version, the system prompt), each request reaches
the actions of the chat on screen and no other, and listeners hear every change of kind exactly once."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from app.ground.screen import OnScreen, Screen

ACTIONS = {"send": ("hi",), "stop": (), "regenerate": (), "edit": (0, "x"), "pin": (1, True),
           "show_version": (1, 0), "set_system_prompt": ("be brief",)}


class Recorder:
    def __init__(self, kind: OnScreen, log: list) -> None:
        for name in ACTIONS:
            setattr(self, name, lambda *args, name=name: log.append((kind, name, args)))


class ScreenMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.log: list = []
        self.heard: list = []
        self.screen = Screen()
        self.screen.register(OnScreen.LOCAL, Recorder(OnScreen.LOCAL, self.log))
        self.screen.subscribe(lambda old, new: self.heard.append((old, new)))
        self.remote_registered = False
        self.kind = OnScreen.LOCAL
        self.changes: list = []

    @rule()
    def remote_chats_made(self) -> None:  # File ▸ Connect… makes the remote controller once
        if not self.remote_registered:
            self.screen.register(OnScreen.REMOTE, Recorder(OnScreen.REMOTE, self.log))
            self.remote_registered = True

    @rule(kind=st.sampled_from(list(OnScreen)))
    def show(self, kind: OnScreen) -> None:
        if kind is OnScreen.REMOTE and not self.remote_registered:
            return  # no remote chat can come on screen before one was made
        if kind is not self.kind:
            self.changes.append((self.kind, kind))
        self.screen.show(kind)
        self.kind = kind

    @rule(name=st.sampled_from(sorted(ACTIONS)))
    def act(self, name: str) -> None:
        before = len(self.log)
        getattr(self.screen, name)(*ACTIONS[name])
        if self.kind is OnScreen.API:  # read only: nothing is done to any chat
            assert len(self.log) == before
        else:
            assert self.log[before:] == [(self.kind, name, ACTIONS[name])]

    @invariant()
    def one_kind_on_screen_and_every_change_heard(self) -> None:
        assert self.screen.kind is self.kind
        assert self.heard == self.changes


TestScreen = ScreenMachine.TestCase
TestScreen.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
