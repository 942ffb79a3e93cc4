"""The JSON of a reply: a whole ``chat.completion`` / ``text_completion``, or its stream's chunks.

Each reply carries its prompt's cache account beside the usage (``"kvscope": {"cache": {...}}``, built by
``engine.server.account``): in the whole reply, on a stream's usage chunk, or on its last chunk when the request
asked for no usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

from engine.server.logprobs import chat_logprobs, completion_logprobs


class Shape:
    """The JSON shapes of one reply: chat (``chat.completion``) or text (``text_completion``). Log-probabilities,
    when asked for, come as ``logprobs.content`` entries (``engine.server.logprobs``), one per token."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text_offset = 0  # characters of token text streamed so far (completions' ``text_offset``)
        self.prompt_ids = None  # the prompt's ids when the request asked ``return_token_ids`` (vLLM's extension)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(data: dict) -> dict[str, Any]:
        p, c = data["prompt_tokens"], data["completion_tokens"]
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": data["cached_tokens"]}}

    def _logprobs(self, entries: list[dict] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries)
        out = completion_logprobs(entries, self.text_offset)
        self.text_offset += sum(len(e["token"]) for e in entries)
        return out

    def whole(self, data: dict) -> dict[str, Any]:
        fr, lp = data["finish_reason"], self._logprobs(data.get("logprobs"))
        if self.kind == "chat":
            calls = data.get("tool_calls") or []
            message = {"role": "assistant", "content": data["text"] if data["text"] or not calls else None}
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": fr}
            return self._with_ids({**self._head("chat.completion"), "choices": [choice], "usage": self.usage(data),
                                   **kvscope(data)}, data)
        choice = {"index": 0, "text": data["text"], "logprobs": lp, "finish_reason": fr}
        return self._with_ids({**self._head("text_completion"), "choices": [choice], "usage": self.usage(data),
                               **kvscope(data)}, data)

    def _with_ids(self, out: dict, data: dict) -> dict:
        if self.prompt_ids is not None:
            out["prompt_token_ids"] = list(self.prompt_ids)
            out["choices"][0]["token_ids"] = list(data.get("token_ids") or ())
        return with_warnings(out, data)

    def first_chunk(self) -> dict[str, Any]:
        """A chat stream's first chunk: the role (and the prompt's ids when asked, as vLLM sends them)."""
        out = self.chunk({"role": "assistant", "content": ""}, None)
        if self.prompt_ids is not None:
            out["prompt_token_ids"] = list(self.prompt_ids)
        return out

    def chunk(self, delta: Any, finish: str | None, logprob: dict | None = None,
              token: int | None = None) -> dict[str, Any]:
        """A stream's chunk: ``delta`` (text, or the chat's role delta), ``logprob``: its token's entry, ``token``:
        its id (sent as ``token_ids`` when the request asked for them)."""
        lp = self._logprobs([logprob]) if logprob is not None else None
        if self.kind == "chat":
            if isinstance(delta, str):
                delta = {"content": delta}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": delta, "logprobs": lp, "finish_reason": finish}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.prompt_ids is not None and token is not None:
            choice["token_ids"] = [token]
        return out

    def tool_chunks(self, data: dict) -> list[dict[str, Any]]:
        """A streamed chat's tool calls: a chunk per call, ``delta.tool_calls`` with its index, id, name and
        arguments (sent whole: the reply is read for calls once it ends)."""
        return [self.chunk({"tool_calls": [c.openai(i)]}, None) for i, c in enumerate(data.get("tool_calls") or [])]

    def last_chunk(self, data: dict, account: bool = False) -> dict[str, Any]:
        """A stream's chunk with the finish reason (and the engine's warnings, when it has any; the cache account
        with ``account``: a stream without a usage chunk)."""
        out = self.chunk("" if self.kind == "completion" else {}, data["finish_reason"])
        return with_warnings({**out, **kvscope(data)} if account else out, data)

    def usage_chunk(self, data: dict) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(data), **kvscope(data)}


def kvscope(data: dict) -> dict[str, Any]:
    """``{"kvscope": {"cache": account}}`` of a finished reply's ``data`` (empty without an account)."""
    return {"kvscope": {"cache": data["cache"]}} if data.get("cache") is not None else {}


def with_warnings(out: dict, data: dict) -> dict:
    """``out`` with a top-level ``warnings`` list when the engine had some for this reply (the KV disk tier's:
    a full or read-only disk, damaged page files dropped); absent otherwise, so replies stay OpenAI's shape."""
    if data.get("warnings"):
        out["warnings"] = list(data["warnings"])
    return out
