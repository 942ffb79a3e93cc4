"""``Screen``: which chat the chat pane shows — a local chat, an API conversation or a remote chat — and so where
every action on it goes.

One owner: the window holds the one ``Screen``; the controllers of each kind (``Conversation``, ``ApiView``,
``RemoteChats``) say when theirs comes on screen (``show``) and register what their chat does with the pane's
requests (``register``). The pane's request signals and the menu's actions are connected once, to this object,
which hands each to the chat on screen: nothing re-wires signals, so an action can never reach a chat that has
left the screen (Regenerate in a remote chat acting on the local chat behind it). Qt-free: listeners are plain
callables (``subscribe``), called on the GUI thread with (old kind, new kind).
"""

from __future__ import annotations

import enum
from typing import Callable, Protocol


class OnScreen(enum.Enum):
    LOCAL = "local"  # a chat of the loaded model
    API = "api"  # an API conversation, read only
    REMOTE = "remote"  # a chat with a model on a server


class ChatActions(Protocol):
    """What a kind of chat does with the pane's requests."""

    def send(self, text: str) -> None: ...
    def stop(self) -> None: ...
    def regenerate(self) -> None: ...
    def edit(self, position: int, text: str) -> None: ...
    def pin(self, position: int, pinned: bool) -> None: ...
    def show_version(self, position: int, index: int) -> None: ...
    def set_system_prompt(self, text: str) -> None: ...


class NoActions:
    """A chat nothing is done to from the pane (an API conversation: its messages come from its client)."""

    def send(self, text: str) -> None: ...
    def stop(self) -> None: ...
    def regenerate(self) -> None: ...
    def edit(self, position: int, text: str) -> None: ...
    def pin(self, position: int, pinned: bool) -> None: ...
    def show_version(self, position: int, index: int) -> None: ...
    def set_system_prompt(self, text: str) -> None: ...


class Screen:
    """The kind of chat on screen (``kind``) and the actions of each kind; actions go to ``kind``'s."""

    def __init__(self) -> None:
        self.kind = OnScreen.LOCAL
        self._actions: dict[OnScreen, ChatActions] = {OnScreen.API: NoActions()}
        self._listeners: list[Callable[[OnScreen, OnScreen], None]] = []

    def register(self, kind: OnScreen, actions: ChatActions) -> None:
        self._actions[kind] = actions

    def subscribe(self, listener: Callable[[OnScreen, OnScreen], None]) -> None:
        self._listeners.append(listener)

    def show(self, kind: OnScreen) -> None:
        """``kind``'s chat is on screen now (its controller has put it in the pane)."""
        if kind is self.kind:
            return
        old, self.kind = self.kind, kind
        for listener in list(self._listeners):
            listener(old, kind)

    @property
    def actions(self) -> ChatActions:
        """What the chat on screen does with a request."""
        return self._actions.get(self.kind) or NoActions()

    # the pane's requests and the menu's actions, each to the chat on screen
    def send(self, text: str) -> None:
        self.actions.send(text)

    def stop(self) -> None:
        self.actions.stop()

    def regenerate(self) -> None:
        self.actions.regenerate()

    def edit(self, position: int, text: str) -> None:
        self.actions.edit(position, text)

    def pin(self, position: int, pinned: bool) -> None:
        self.actions.pin(position, pinned)

    def show_version(self, position: int, index: int) -> None:
        self.actions.show_version(position, index)

    def set_system_prompt(self, text: str) -> None:
        self.actions.set_system_prompt(text)
