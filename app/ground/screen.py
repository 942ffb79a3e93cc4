"""``Screen``: which chat the chat pane shows — a local chat, an API conversation or a remote chat — and so where
every action on it goes.

One owner: the window holds the one ``Screen``; the controllers of each kind (``Conversation``, ``ApiView``,
``RemoteChats``) say when theirs comes on screen (``show``) and register what their chat does with the pane's
requests (``register``). The pane's request signals and the menu's actions are connected once, to this object,
which hands each to the chat on screen: nothing re-wires signals, so an action can never reach a chat that has
left the screen (Regenerate in a remote chat acting on the local chat behind it). Qt-free: listeners are plain
callables (``subscribe``), called on the GUI thread with (old kind, new kind).

It is also the one record of what the screen shows of that chat (napari's ``ViewerModel`` is the model for it): the
chat, its reply in flight, its newest snapshot and the frame the panels draw, its context counts, the cache
setting applied to it and the one the status bar names, its decode speed and its last prompt's cache account. The
writers (``app.shell.readouts.ScreenWriter``: the worker's, the conversation's, the cache controller's and the
server's news) set fields with ``update``; every surface (status bar, panels and their scheduler, trace, timing,
Why dock, cache controls, send check, chat pane) subscribes to the fields it shows (``connect``) and reads them
here, so no part writes another's widgets and one number of one chat is one field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Protocol

from app.ground.evented import Evented


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


@dataclass(frozen=True)
class Context:
    """The chat on screen's context: ``used`` of the model's ``total`` positions (``app.ground.status_bar.
    context_counts``), every token of the ``chat`` so far (dropped ones too), under the overflow setting named."""

    used: int = 0
    total: int = 0
    chat: int = 0
    overflow: str = "stop"

    @property
    def dropped(self) -> int:
        return max(self.chat - self.used, 0)


@dataclass(frozen=True)
class ReplyView:
    """The reply the screen shows for its chat: the one in flight, else the chat's last one. ``stats``: as saved
    with it (TTFT, decode speed, the cache account, ...; empty while it runs); ``label``: its cache mode(s) in the
    timing caption's words."""

    generation_id: int = 0
    label: str = ""
    running: bool = False
    stats: dict = field(default_factory=dict)


class Screen(Evented):
    """The kind of chat on screen (``kind``) and the actions of each kind; actions go to ``kind``'s. The other
    fields are what the screen shows of that chat (see the module)."""

    FIELDS = {
        "kind": OnScreen.LOCAL,
        "chat": None,  # a local chat's id, ("api", session id) or ("remote", chat id); None: none yet
        "generation": 0,  # the reply in flight in the chat on screen (0: none)
        "reply": ReplyView(),  # that reply, or the chat's last
        "latest": None,  # the chat's newest CacheSnapshot (None: nothing cached)
        "frame": None,  # the snapshot the panels draw now (the status bar describes the same one)
        "context": None,  # Context, or None before anything is known
        "settings": None,  # the CacheConfig applied to the chat on screen
        "shown_settings": None,  # the setting the status bar names: changes with the first frame taken under it
        "speed": 0.0,  # the decode speed shown: the reply in flight's, else the chat's last reply's
        "account": None,  # the chat's last prompt's cache account (dict, as saved with a reply) and its places
        "said": (),  # what the engine just told the user about this chat (notes), each once
    }
    BY_IDENTITY = frozenset({"latest", "frame", "said"})

    def __init__(self) -> None:
        super().__init__()
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
        old = self.kind
        self.update(kind=kind)
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
