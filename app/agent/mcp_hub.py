"""Tools from MCP servers (the ``mcp`` package; Qt-free): the stdio servers the user configured, each started once
as a child process when first needed and kept while the app runs, spoken to on one asyncio loop on a thread of its
own. Every answer is a ``concurrent.futures.Future``: the GUI never waits on a server.

Each server lives in one task (the ``mcp`` client's streams must be entered and left in the same task): it starts
the process, initializes the session and then serves the requests put in its queue — list the tools, call one —
until the hub closes. A server that cannot start, or does not answer within its time, is one line naming it (with
the last line it wrote to stderr); the others go on. Results are text, bounded (``MAX_RESULT`` characters).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import shlex
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

LIST_TIMEOUT_S = 30.0  # starting a server and listing its tools (a Python server imports its SDK: ~1 s here)
CALL_TIMEOUT_S = 120.0  # one tool call
MAX_RESULT = 16_000  # characters of a tool's result handed to the model (a page of text; the rest is cut, said so)
_NAME = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class ServerSpec:
    """A stdio MCP server: its name (the user's) and the command that starts it."""

    name: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_line(cls, name: str, line: str) -> "ServerSpec":
        """``name`` and a command line as a shell splits it (``uvx mcp-server-time``); ValueError naming what is
        wrong (an empty name or command, an unclosed quote)."""
        name = name.strip()
        if not name:
            raise ValueError("an MCP server needs a name")
        try:
            parts = shlex.split(line)
        except ValueError as e:
            raise ValueError(f"{name}: the command line cannot be read ({e})") from None
        if not parts:
            raise ValueError(f"{name}: the command is empty")
        return cls(name, parts[0], tuple(parts[1:]))

    def line(self) -> str:
        return shlex.join([self.command, *self.args])


@dataclass(frozen=True)
class McpTool:
    """One tool: the server it is on, the name the model sees (``name``: letters, digits, _ and -, unique among the
    servers') and the server's own (``remote``), what it does and its parameters' JSON schema."""

    server: str
    name: str
    remote: str
    description: str = ""
    schema: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema}}


@dataclass(frozen=True)
class ToolResult:
    text: str
    error: bool = False


def model_names(found: list[tuple[str, str]]) -> list[str]:
    """The names the model sees for (server, tool) pairs: the tool's own where it is unique and valid, else
    ``server_tool`` made valid (OpenAI's rule: [A-Za-z0-9_-], at most 64), numbered where still taken."""
    counts: dict[str, int] = {}
    for _server, tool in found:
        counts[tool] = counts.get(tool, 0) + 1
    out, taken = [], set()
    for server, tool in found:
        name = tool if counts[tool] == 1 and not _NAME.search(tool) else _NAME.sub("_", f"{server}_{tool}")
        name, base, i = name[:64], name[:60], 2
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        out.append(name)
    return out


def result_text(result: Any) -> ToolResult:
    """A ``CallToolResult`` as the text the model reads: its text parts, other parts named ("[an image, image/png]"),
    cut at ``MAX_RESULT`` characters (said so)."""
    parts = []
    for c in getattr(result, "content", None) or ():
        kind = getattr(c, "type", "")
        if kind == "text":
            parts.append(c.text)
        else:
            mime = getattr(c, "mime_type", None) or getattr(c, "mimeType", None) or ""
            parts.append(f"[{'an' if kind[:1] in 'aeiou' else 'a'} {kind or 'part'}{', ' + mime if mime else ''}]")
    structured = getattr(result, "structured_content", None) or getattr(result, "structuredContent", None)
    text = "\n".join(parts) if parts else (str(structured) if structured else "")
    if len(text) > MAX_RESULT:
        text = text[:MAX_RESULT] + f"\n[cut: the result had {len(text):,} characters, the first {MAX_RESULT:,} kept]"
    error = bool(getattr(result, "is_error", False) or getattr(result, "isError", False))
    return ToolResult(text, error)


class McpHub:
    """The configured servers; ``tools()`` and ``call()`` from any thread, ``close()`` once."""

    def __init__(self, servers: list[ServerSpec], list_timeout: float = LIST_TIMEOUT_S,
                 call_timeout: float = CALL_TIMEOUT_S) -> None:
        self.servers = {s.name: s for s in servers}
        self.list_timeout, self.call_timeout = list_timeout, call_timeout
        self._loop = asyncio.new_event_loop()
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[concurrent.futures.Future] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvscope-mcp", daemon=True)
        self._thread.start()
        self.closed = False

    def tools(self) -> concurrent.futures.Future:
        """(tools, problems): every server's tools with the names the model sees, and one line per server that
        failed (its tools are left out)."""
        return asyncio.run_coroutine_threadsafe(self._tools(), self._loop)

    def call(self, tool: McpTool, arguments: dict) -> concurrent.futures.Future:
        """``tool`` called with ``arguments``: a ``ToolResult`` (a failure is one with ``error`` and the reason)."""
        return asyncio.run_coroutine_threadsafe(self._ask(tool.server, "call", (tool.remote, arguments),
                                                          self.call_timeout), self._loop)

    def close(self) -> None:
        """Stop every server (their processes end) and the loop's thread."""
        if self.closed:
            return
        self.closed = True
        for q in self._queues.values():
            self._loop.call_soon_threadsafe(q.put_nowait, None)
        for t in self._tasks:
            try:
                t.result(timeout=5)
            except Exception:  # noqa: BLE001 - closing: a server that will not stop is killed with the loop
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # -- the loop's side ----------------------------------------------------------------------------------
    async def _tools(self) -> tuple[list[McpTool], list[str]]:
        names = list(self.servers)
        got = await asyncio.gather(*(self._ask(n, "list", None, self.list_timeout) for n in names),
                                   return_exceptions=True)
        found, problems = [], []
        for name, answer in zip(names, got):
            if isinstance(answer, BaseException):
                problems.append(f"{name}: {answer}")
                continue
            found += [(name, t) for t in answer]
        labels = model_names([(s, getattr(t, "name", "")) for s, t in found])
        tools = [McpTool(s, label, t.name, getattr(t, "description", None) or "",
                         _schema(getattr(t, "input_schema", None) or getattr(t, "inputSchema", None)))
                 for (s, t), label in zip(found, labels)]
        return tools, problems

    async def _ask(self, server: str, what: str, payload: Any, timeout: float) -> Any:
        if server not in self._queues:
            self._queues[server] = asyncio.Queue()
            started = self._loop.create_future()
            task = asyncio.ensure_future(self._serve(self.servers[server], self._queues[server], started))
            self._tasks.append(_done_future(task))
            try:
                await asyncio.wait_for(asyncio.shield(started), self.list_timeout)
            except asyncio.TimeoutError:
                raise RuntimeError(f"did not start within {self.list_timeout:.0f} s") from None
        reply = self._loop.create_future()
        await self._queues[server].put((what, payload, reply))
        try:
            return await asyncio.wait_for(reply, timeout)
        except asyncio.TimeoutError:
            if what == "call":
                return ToolResult(f"the tool did not answer within {timeout:.0f} s", True)
            raise RuntimeError(f"did not answer within {timeout:.0f} s") from None

    async def _serve(self, spec: ServerSpec, queue: asyncio.Queue, started: asyncio.Future) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        err = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        params = StdioServerParameters(command=spec.command, args=list(spec.args),
                                       env={**os.environ, **dict(spec.env)} if spec.env else None)
        try:
            async with stdio_client(params, errlog=err) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    if not started.done():
                        started.set_result(True)
                    await self._answer(session, queue)
        except BaseException as e:  # noqa: BLE001 - said as one line; the app goes on
            why = _why(e, spec, err)
            if not started.done():
                started.set_exception(RuntimeError(why))
            while not queue.empty():  # requests that came meanwhile get the reason
                item = queue.get_nowait()
                if item is not None and not item[2].done():
                    item[2].set_exception(RuntimeError(why))
            self._queues.pop(spec.name, None)  # a later request starts it again
        finally:
            err.close()

    async def _answer(self, session, queue: asyncio.Queue) -> None:
        while True:
            item = await queue.get()
            if item is None:
                return
            what, payload, reply = item
            try:
                if what == "list":
                    listed = await session.list_tools()
                    out = list(listed.tools)
                else:
                    out = result_text(await session.call_tool(payload[0], payload[1]))
            except Exception as e:  # noqa: BLE001 - the tool's failure is its result, the session goes on
                out = e if what == "list" else ToolResult(f"the call failed: {_first_line(e)}", True)
            if not reply.done():
                (reply.set_exception if isinstance(out, Exception) else reply.set_result)(out)


def _done_future(task: asyncio.Task) -> concurrent.futures.Future:
    """A thread-safe future set when ``task`` ends (``close`` waits on it from another thread)."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    task.add_done_callback(lambda _t: out.set_result(None))
    return out


def _schema(schema: Any) -> dict:
    if isinstance(schema, dict) and schema.get("type") == "object":
        return dict(schema)
    return {"type": "object", "properties": {}}


def _first_line(e: BaseException) -> str:
    inner = getattr(e, "exceptions", None)  # anyio's task groups wrap the real error
    if inner:
        return _first_line(inner[0])
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _why(e: BaseException, spec: ServerSpec, err) -> str:
    """One line: what failed, and the last line the server wrote to stderr (where it says why)."""
    try:
        err.seek(0)
        said = [ln.strip() for ln in err.read()[-4000:].splitlines() if ln.strip()]
    except (OSError, ValueError):
        said = []
    inner = _first_line(e)
    if isinstance(e, ImportError):
        return 'the mcp package is not installed here (pip install "kvscope[mcp]")'
    if isinstance(e, FileNotFoundError) or "No such file" in inner:
        return f'could not start "{spec.command}": no such program'
    tail = f" (it said: {said[-1][:200]})" if said else ""
    return f"stopped: {inner}{tail}"
