"""A chat in the window as an agent: the tools of the MCP servers the user configured (Settings ▸ Tools; off by
default) go with each reply, and a reply that calls one runs the loop LM Studio users expect —

    the model's call (read by the server's own parsers: ``app.link.tool_replies``) → shown, and confirmed by the
    user (``ToolCallDialog``: Run / Don't run) → the MCP server called (``app.agent.mcp_hub``) → its result added
    to the chat as a tool message → the model goes on from it (``Conversation.continue_reply``)

— until a reply calls nothing, the user declines a call, or ``MAX_ROUNDS`` rounds ran since the user's message. A
declined call still gets a result ("declined by the user"), so the chat stays one the template can render.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.agent.confirm import ToolCallDialog
from app.agent.mcp_hub import McpHub, McpTool, ServerSpec, ToolResult
from app.link.tool_replies import ToolUse

MAX_ROUNDS = 8  # tool rounds after one message of the user's before the loop stops and says so
DECLINED = "The user declined this call: it did not run."


@dataclass
class Pending:
    """A call of a finished reply, waiting for the user's word or the server's result."""

    chat_id: int
    call: dict  # the API's form: {"id", "type", "function": {"name", "arguments"}}
    tool: McpTool | None  # None: the model named no tool the servers have


def servers_from(settings) -> list[ServerSpec]:
    """The configured servers (``mcp/servers``: [{"name", "command", "on"}]); a line that cannot be read is left
    out (the Tools page said why when it was entered)."""
    out = []
    for s in settings.get("mcp/servers") or []:
        if isinstance(s, dict) and s.get("on", True):
            try:
                out.append(ServerSpec.from_line(str(s.get("name", "")), str(s.get("command", ""))))
            except ValueError:
                continue
    return out


class AgentLoop(QObject):
    """Owned by the window: ``configure()`` after the Tools settings change; ``tools`` / ``problems`` as listed."""

    listed = Signal(object, object)  # tools, problems: the servers' tools were (re)listed
    _got_tools = Signal(object, object)  # from the hub's thread
    _answered = Signal(object, object)  # Pending, ToolResult (from the hub's thread)

    def __init__(self, settings, conversation, worker, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings, self.conv = settings, conversation
        self.hub: McpHub | None = None
        self.tools: list[McpTool] = []
        self.problems: list[str] = []
        self.listing = False
        self.dialog: ToolCallDialog | None = None  # the call waiting for the user's word
        self.rounds = 0  # tool rounds since the user's last message
        self._turns: dict[int, Any] = {}  # generation id -> its ``ToolTurn``
        self._queue: list[Pending] = []
        self._continuing = False  # the reply starting is the loop's own (``_go_on``)
        self._got_tools.connect(self._on_tools)
        self._answered.connect(self._on_answered)
        worker.called.connect(lambda gen, turn: self._turns.__setitem__(gen, turn))
        conversation.reply_finished.connect(self._on_finished)
        conversation.reply_started.connect(self._on_started)
        conversation.user_sending.connect(self._on_user_sending)
        conversation.tool_use = self.tool_use
        self.configure()

    @property
    def busy(self) -> bool:
        """Calls of a reply wait for the user's word or for their results."""
        return bool(self._queue)

    @property
    def enabled(self) -> bool:
        return bool(self.settings.get("mcp/enabled"))

    def configure(self) -> None:
        """Start the configured servers afresh (the old ones stop) and list their tools; nothing when off."""
        self.close()
        self.tools, self.problems = [], []
        servers = servers_from(self.settings) if self.enabled else []
        if not servers:
            self.listed.emit([], [])
            return
        self.hub, self.listing = McpHub(servers), True
        self.hub.tools().add_done_callback(lambda f: self._got_tools.emit(*_tools_of(f)))

    def close(self) -> None:
        hub, self.hub = self.hub, None
        if hub is not None:
            hub.close()

    def _on_tools(self, tools: list, problems: list) -> None:
        self.listing = False
        self.tools, self.problems = list(tools), list(problems)
        for line in problems:
            self.conv.error.emit(f"MCP server {line}")
        self.listed.emit(self.tools, self.problems)

    # -- a reply's tools ----------------------------------------------------------------------------------
    def tool_use(self, messages: list[dict]) -> ToolUse | None:
        """The tools a reply to ``messages`` may call (None: tools are off, or none is listed yet). "Call a tool
        first" forces a call in the reply to the user's message only: after a result the model may answer."""
        if not self.enabled or not self.tools:
            return None
        from_user = bool(messages) and messages[-1].get("role") == "user"
        if from_user:
            self.rounds = 0
        first = self.settings.get("mcp/tool_choice") == "first" and from_user
        return ToolUse(tuple(t.openai() for t in self.tools), "required" if first else "auto")

    def _on_user_sending(self) -> None:
        """The user's message comes while a call waits for their word: the call is declined first, so its result
        sits right after it and the message after that (the template renders a call's result after the call)."""
        if self._queue:
            self._decline_all()

    def _on_started(self, _generation_id: int, _mode: str) -> None:
        """A new reply began that is not the loop's own (a regenerated or edited message): a call still waiting for
        the user's word belongs to an earlier turn — declined, so the chat keeps a result for every call (a call
        whose message the new reply replaced gets none: nothing in the chat would stand before it)."""
        if self._queue and not self._continuing:
            self._decline_all(still_in_chat=True)

    def _on_finished(self, generation_id: int, _reason: str) -> None:
        turn = self._turns.pop(generation_id, None)
        reply = self.conv.last_reply
        if turn is None or not turn.calls or reply is None or reply.generation_id != generation_id:
            return
        history = self.conv.history
        found = next((m for m in history.messages(reply.chat_id) if m.id == reply.message_id), None)
        stats = {**(found.stats if found else {}), "tool_calls": list(turn.calls)}
        history.set_stats(reply.message_id, stats)
        history.set_content(reply.message_id, turn.content)
        if reply.chat_id == self.conv.chat_id:
            bubble = next((b for b in self.conv.pane.bubbles if b.position == reply.position), None)
            if bubble is not None:
                bubble.set_stats(stats)  # it says which tools it called
            self.conv.pane.set_text_at(reply.position, turn.content)
        by_name = {t.name: t for t in self.tools}
        self._queue = [Pending(reply.chat_id, c, by_name.get(c["function"]["name"])) for c in turn.calls]
        self._next()

    # -- one call at a time ---------------------------------------------------------------------------------
    def _next(self) -> None:
        if not self._queue:
            self._go_on()
            return
        p = self._queue[0]
        if p.tool is None or self.hub is None:
            name = p.call["function"]["name"]
            self._answered.emit(p, ToolResult(f"There is no tool named {name!r}: the tools are "
                                              f"{', '.join(t.name for t in self.tools) or 'none'}.", True))
            return
        self.dialog = ToolCallDialog(p.tool, _arguments(p.call), self.conv.pane.window())
        self.dialog.decided.connect(lambda run, p=p: self._on_decided(p, run))
        self.dialog.show()

    def _on_decided(self, p: Pending, run: bool) -> None:
        self.dialog = None
        if not self._queue or self._queue[0] is not p:
            return  # an earlier turn's
        if not run:
            self._decline_all()
            return
        self.hub.call(p.tool, _arguments(p.call)).add_done_callback(
            lambda f, p=p: self._answered.emit(p, _result_of(f)))

    def _on_answered(self, p: Pending, result: ToolResult) -> None:
        if not self._queue or self._queue[0] is not p:
            return
        self._queue.pop(0)
        self._add_result(p, result.text, "failed" if result.error else "done")
        self._next()

    def _decline_all(self, still_in_chat: bool = False) -> None:
        """The user declined a call: it and the rest of the reply's calls get 'declined' results (``still_in_chat``:
        only calls whose message is still in their chat); the loop stops."""
        queue, self._queue = self._queue, []
        if self.dialog is not None:
            self.dialog.close()
            self.dialog = None
        for p in queue:
            if not still_in_chat or self._in_chat(p):
                self._add_result(p, DECLINED, "declined")

    def _in_chat(self, p: Pending) -> bool:
        return any(c.get("id") == p.call["id"] for m in self.conv.history.messages(p.chat_id)
                   if m.role == "assistant" for c in (m.stats.get("tool_calls") or []))

    def _add_result(self, p: Pending, text: str, status: str) -> None:
        fn = p.call["function"]
        stats = {"tool_call_id": p.call["id"], "name": fn["name"], "server": p.tool.server if p.tool else "",
                 "arguments": fn["arguments"], "status": status}
        msg = self.conv.history.add_message(p.chat_id, "tool", text)
        self.conv.history.set_stats(msg.id, stats)
        if p.chat_id == self.conv.chat_id:
            self.conv.pane.add_message("tool", text, msg.position).set_stats(stats)

    def _go_on(self) -> None:
        """Every call of the reply has its result: the model goes on from them (in the chat they belong to)."""
        self.rounds += 1
        if self.rounds >= MAX_ROUNDS:
            self.conv.error.emit(f"The model called tools {MAX_ROUNDS} times after your message: the loop stopped "
                                  "there. Send a message to go on.")
            return
        self._continuing = True
        try:
            self.conv.continue_reply()
        finally:
            self._continuing = False


def _arguments(call: dict) -> dict:
    args = call["function"].get("arguments", "{}")
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tools_of(future) -> tuple[list, list]:
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - said as one line
        return [], [f"tools could not be listed: {e}"]


def _result_of(future) -> ToolResult:
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - the call's failure is its result
        return ToolResult(f"the call failed: {e}", True)
