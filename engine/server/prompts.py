"""A request's prompt made ready before it queues: rendered and tokenized on a thread of its own, never the engine's.

A 3.9 MB prompt took 4 s to tokenize (peak RSS 0.5 → 1.3 GB) on the engine thread, and every reply waited
(a "Hi" sent 0.15 s later: 3.9 s). Here ``Tokenizing.prepare`` runs on one of two threads: prompts up to
``LARGE_CHARS`` characters on one, longer ones on the other, so a long prompt never delays a short one (the
tokenizer is only called, never reconfigured, so two calls at once are safe). It first refuses a prompt whose
characters alone cannot fit the context: no token of this vocabulary spells more than ``max_token_chars``
characters, so ``chars / max_token_chars`` tokens at least (x4 for normalizers that fold runs of characters).
A chat whose assistant messages are replies this server gave holds the ids it fed through them
(``engine.server.reply_ids``), so the follow-up reuses the reply too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any

from engine.config import CacheConfig
from engine.server.errors import ApiError, bad_request
from engine.server.reply_ids import ReplyIds
from engine.server.schemas import GenRequest

FOLD_MARGIN = 4  # a normalizer may fold a run of characters (spaces) into fewer tokens than chars / longest
LARGE_CHARS = 32 * 1024  # ~8k tokens: tokenized in tens of ms; longer prompts take the other thread
SPLICE_TRIES = 3  # assistant messages (latest first) looked up for the ids fed through them


@dataclass(frozen=True)
class Prepared:
    """A request's prompt as the engine takes it: ids, the messages' token spans (policies protect the system
    prompt by them; empty when no policy needs them) and the tokens the reply may generate."""

    ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    max_new: int
    mark: int = -1  # where the last message starts: a checkpoint there on a hybrid / sliding model serves a branch
    constraint: Any = None  # engine.server.constrain.Constraint: a grammar, the tool-call format to read


class Tokenizing:
    """Renders and tokenizes requests off the engine thread (``prepare``), one at a time."""

    def __init__(self, lm, cache: CacheConfig, max_tokens: int) -> None:
        self.lm, self.cache, self.max_tokens = lm, cache, max_tokens
        self.bounded, self.needs_spans = cache.bounded_by_context, cache.needs_spans
        self.replies = ReplyIds()  # written by the engine thread at each chat reply's end (``Scheduler._end``)
        self.small = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvscope-tokenize")
        self.large = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvscope-tokenize-large")
        self.started = {"small": 0, "large": 0}  # prompts each thread took up (tests, tools)
        self.large_busy = 0  # long prompts being tokenized now
        self._max_chars: int | None = None

    async def prepare(self, req: GenRequest, tenant: bytes = b"") -> Prepared:
        """The request's ``Prepared`` (400 naming the field for a prompt that cannot be served as asked);
        ``tenant``: whose earlier replies' ids the prompt may hold."""
        chars = self._check_size(req) + (len(repr(req.tools)) if req.tools else 0)  # tools are rendered too
        lane = "large" if chars > LARGE_CHARS else "small"
        self.started[lane] += 1
        pool = self.large if lane == "large" else self.small
        if lane == "small":
            return await asyncio.get_running_loop().run_in_executor(pool, self._prepare, req, tenant)
        self.large_busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, self._prepare, req, tenant)
        finally:
            self.large_busy -= 1

    def close(self) -> None:
        for pool in (self.small, self.large):
            pool.shutdown(wait=False, cancel_futures=True)

    def max_token_chars(self) -> int:
        """Characters of the longest token (its vocabulary piece: a byte-level or ``<0x..>`` piece is no
        shorter than its text)."""
        if self._max_chars is None:
            vocab = self.lm.tokenizer.get_vocab()
            self._max_chars = max(1, max((len(p) for p in vocab), default=1))
        return self._max_chars

    def _check_size(self, req: GenRequest) -> int:
        """The prompt's characters; 400 when they cannot fit the context (checked before any tokenizing)."""
        chars = sum(len(m["content"]) for m in req.messages) if req.kind == "chat" else len(req.prompt or "")
        if not self.bounded or self.lm.tokenizer is None or req.prompt_ids:
            return chars
        ctx, longest = self.lm.info.context_length, self.max_token_chars()
        if chars > ctx * longest * FOLD_MARGIN:
            what = "messages" if req.kind == "chat" else "prompt"
            raise bad_request(f"This model's maximum context length is {ctx} tokens. However, your {what} has {chars} "
                              f"characters: at least {chars // longest} tokens (no token is longer than {longest} "
                              f"characters). Please reduce the length of the {what}.", what, "context_length_exceeded")
        return chars

    def _prepare(self, req: GenRequest, tenant: bytes = b"") -> Prepared:
        from engine.model.chat import encode_prompt
        from engine.server.constrain import constraint_of
        from engine.server.render import render_messages, spans as message_spans

        tok = self.lm.tokenizer
        if tok is None:
            raise ApiError(503, "this model has no tokenizer", "server_error", None, "no_tokenizer")
        spans: list[tuple[int, int]] = []
        mark = -1
        try:
            if req.kind == "chat":
                fresh = render_messages(tok, req.messages, req.tools, model=self.lm.info.name)
                ids = self.with_replies(fresh, req.messages, tenant)
                spans = message_spans(tok, req.messages, req.tools) if self.needs_spans else []
                if any(k != "full" for k in self.lm.info.layer_kinds) and len(req.messages) > 1:
                    # windows or states: cut back to checkpoints; the tail after the splice is the fresh render's
                    at = len(ids) - (len(fresh) - len(render_messages(tok, req.messages[:-1], req.tools, False)))
                    mark = at if 0 < at < len(ids) else -1
            elif req.prompt is not None:
                ids = encode_prompt(tok, req.prompt)
                if not ids:
                    raise bad_request("prompt: empty after tokenization (nothing to complete)", "prompt")
            else:
                ids = self._checked_ids(req.prompt_ids)
        except ValueError as e:  # a template's refusal, text that is not Unicode: the request's fault
            raise bad_request(str(e).splitlines()[0], "messages" if req.kind == "chat" else "prompt") from None
        return Prepared(tuple(ids), tuple(spans), self.max_new(req, len(ids)), mark, constraint_of(self.lm, req))

    def with_replies(self, ids: list[int], messages, tenant: bytes) -> list[int]:
        """``ids`` (the chat rendered afresh) holding the ids this server fed through the latest of its assistant
        messages it knows (``tenant``'s own), wherever they spell the same text (``engine.model.splice``)."""
        if not self.cache.prefix_reuse:
            return ids
        from engine.model.splice import splice

        best, tries = None, 0
        from engine.server.render import reply_text

        for m in reversed(list(messages)):
            key = reply_text(m) if m["role"] == "assistant" else ""
            if not key:
                continue
            fed = self.replies.find(tenant, key)
            if fed is None:
                continue
            s = splice(self.lm.tokenizer, fed, ids)
            if max(s.kept, s.common) >= len(fed):  # all of them: the usual follow-up (or the fresh ids had them)
                return s.ids
            if s.spliced and (best is None or s.kept > best.kept):  # a short reply ("OK") another chat gave too
                best = s
            tries += 1
            if tries >= SPLICE_TRIES:  # an earlier reply's ids are a start of a later one's: rarely worth more
                break
        return best.ids if best is not None else ids

    def _checked_ids(self, ids) -> list[int]:
        vocab = self.lm.info.vocab_size
        if max(ids) >= vocab:
            raise bad_request(f"prompt: token id {max(ids)} is outside the vocabulary (0..{vocab - 1})", "prompt",
                              "invalid_value")
        return list(ids)

    def max_new(self, req: GenRequest, n: int) -> int:
        """Tokens this reply may generate: ``max_tokens``, checked against the context and the server's cap (400
        with the numbers)."""
        ctx, bounded = self.lm.info.context_length, self.bounded
        what = "messages" if req.kind == "chat" else "prompt"
        if bounded and n >= ctx:
            raise bad_request(f"This model's maximum context length is {ctx} tokens. However, your {what} "
                              f"resulted in {n} tokens. Please reduce the length of the {what}.", what,
                              "context_length_exceeded")
        cap = self.max_tokens
        if req.max_tokens is not None and req.max_tokens > cap:
            raise bad_request(f"max_tokens: {req.max_tokens} is above this server's limit of {cap} tokens per reply "
                              "(its --max-tokens)", "max_tokens", "invalid_value")
        if req.max_tokens is None:
            room = min(cap, max(1, ctx - n) if bounded else ctx)
            if req.min_tokens > room:
                raise bad_request(f"min_tokens: {req.min_tokens} is more than this reply can hold ({room} tokens: the "
                                  f"context of {ctx} less the {n} of the {what}, at most {cap} per reply)",
                                  "min_tokens", "invalid_value")
            return room
        if bounded and n + req.max_tokens > ctx:
            raise bad_request(f"This model's maximum context length is {ctx} tokens. However, you requested "
                              f"{n + req.max_tokens} tokens ({n} in the {what}, {req.max_tokens} in the completion). "
                              f"Please reduce the length of the {what} or completion.", "max_tokens",
                              "context_length_exceeded")
        return req.max_tokens
