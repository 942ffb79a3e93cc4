"""Connecting remote chats: File ▸ Connect to a server…, a new chat on a server, the chats saved by earlier
sessions (listed not connected, connected again into the same chat), deleting one. A part of ``RemoteChats``
(``app.remote.chat``), which holds the state these methods use; kept apart to keep each file readable.
"""

from __future__ import annotations

from app.remote.dialog import ConnectDialog
from app.remote.chat_list import RemoteChat
from app.remote.worker import RemoteLink


class Connecting:
    """The connecting half of ``RemoteChats`` (a mixin: its attributes are set in ``RemoteChats.__init__``)."""

    # -- connecting -----------------------------------------------------------------------------------------
    def open_dialog(self, again: RemoteChat | None = None) -> ConnectDialog:
        """File ▸ Connect to a server…; ``again``: a saved chat to connect to its server again (the dialog is
        filled with its URL, events endpoint and model; the key was never saved)."""
        if self.dialog is None:
            self.dialog = ConnectDialog(self.window, self._known)
            self.dialog.connected.connect(self.add_link)
            self.dialog.rejected.connect(self._not_reconnecting)
        self._reconnecting = again
        if again is not None:
            self.dialog.prefill(again.url, again.events, again.model_name)
        self.dialog.show_error("")
        self.dialog.open()  # window-modal, and the event loop runs: nothing waits on the network
        return self.dialog

    def _not_reconnecting(self) -> None:
        self._reconnecting = None

    def _known(self, url: str, api_key: str) -> RemoteLink | None:
        return next((link for link in self.links if link.serves(url, api_key)), None)

    def add_link(self, link: RemoteLink, model: str = "") -> RemoteChat:
        """A server answered (or was open already): a new remote chat with ``model`` (the server's first when
        ''), on screen — or, when the dialog was opened for a saved chat, that chat connected again."""
        if link not in self.links:
            self.links.append(link)
            link.worker.prompt.connect(self._on_prompt)
            link.worker.delta.connect(self._on_delta)
            link.worker.finished.connect(self._on_finished)
            link.events.connect(self._on_events)
            self.window.status.message(f"Connected to {link.engine.client.url}: {', '.join(link.engine.models)}",
                                       6000)
        again, self._reconnecting = self._reconnecting, None
        if again is not None and self.chats.get(again.id) is again:
            self._attach(again, link, model)
            return again
        return self.new_chat(link, model)

    def new_chat(self, link: RemoteLink, model: str = "") -> RemoteChat:
        """Another chat with ``link``'s server, on screen (the list's "New chat on this server")."""
        eng = link.engine
        model = model if model in eng.models else eng.model
        rc = RemoteChat(0, link, url=eng.client.url, model_name=model, events=link.events_given)
        rc.id = self.saver.create(rc.url, model, rc.events)
        self.chats[rc.id] = rc
        self.label.setVisible(True)
        self.list.setVisible(True)
        self.open_chat(rc.id)
        self.chat_added.emit(rc)
        return rc

    def _new_like(self, chat_id: int, model: str = "") -> None:
        """The list's "New chat on this server": with ``model`` (or that chat's), connecting first when it is not
        connected."""
        rc = self.chats[chat_id]
        if rc.connected:
            self.new_chat(rc.link, model or rc.model_name)
        else:
            dialog = self.open_dialog()
            dialog.prefill(rc.url, rc.events, rc.model_name)

    def show_saved(self) -> None:
        """List the chats saved by earlier sessions (not connected)."""
        for rc in self.saver.saved():
            self.chats.setdefault(rc.id, rc)
        self.label.setVisible(bool(self.chats))
        self.list.setVisible(bool(self.chats))
        self._refresh_list()

    def _attach(self, rc: RemoteChat, link: RemoteLink, model: str = "") -> None:
        """A saved chat goes on with ``link``'s server: its model when the server still serves it (else the one
        asked for, else the server's first — said in the status bar)."""
        eng = link.engine
        wanted = model or rc.model_name
        chosen = wanted if wanted in eng.models else eng.model
        if wanted and chosen != wanted:
            self.window.status.message(f"{eng.client.url} does not serve {wanted} now: this chat goes on with "
                                       f"{chosen}", 10000)
        rc.link, rc.url, rc.model_name = link, eng.client.url, chosen
        rc.events = link.events_given or rc.events
        self.saver.set_server(rc)
        if rc is self.current:
            self._show(rc)
        else:
            self.open_chat(rc.id)
        self._refresh_list()
        self.link_attached.emit(rc)

    def close_chat(self, chat_id: int) -> None:
        """Delete a remote chat (from the history too): its reply stops; a server no chat uses is let go."""
        rc = self.chats.get(chat_id)
        if rc is None:
            return
        if rc.cancel is not None:
            rc.cancel.set()
        if rc is self.current:
            self.window.conversation.load_chats()  # the last local chat comes back (and ``leave`` runs)
        del self.chats[chat_id]
        self.saver.delete(rc)
        if rc.link is not None and not any(c.link is rc.link for c in self.chats.values()):
            self.links.remove(rc.link)
            rc.link.release(busy=bool(rc.generation))
        self.label.setVisible(bool(self.chats))
        self.list.setVisible(bool(self.chats))
        self._refresh_list()


def offline_text(rc: RemoteChat) -> str:
    return (f"Saved from a chat with {rc.model} at {rc.url}. Connect to that server again to go on with it (an API "
            "key is asked for again: it is never saved).")
