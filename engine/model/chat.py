"""Prompt rendering (the tokenizer's chat template, or a plain fallback) and UTF-8-safe streaming text."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

ROLES = ("system", "user", "assistant")
_PLAIN_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def check_text(text: str, what: str) -> str:
    """Refuse text that is not valid Unicode (a lone surrogate: from ``"\\ud800"`` in JSON, or non-UTF-8
    bytes in argv): tokenizers fail on it deep inside, with an error that names nothing the user wrote."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: invalid character {ascii(text[e.start])} at position {e.start} "
                         "(a lone surrogate, not valid Unicode): use UTF-8 text") from None
    return text


def validate_messages(messages: Sequence[dict[str, Any]], for_reply: bool = True) -> list[dict[str, Any]]:
    """Check a chat: a list of ``{"role", "content"}`` with known roles, ending with a user message.

    Optional keys kept: ``pinned`` (bool) and ``priority`` (0..100) for the priority eviction policy."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}]: expected an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}]: role {m['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}]: content must be a string")
        check_text(m["content"], f"messages[{i}] content")
        item = {"role": m["role"], "content": m["content"]}
        if m.get("pinned"):
            item["pinned"] = True
        if "priority" in m and m["priority"] is not None:
            if not isinstance(m["priority"], int) or not 0 <= m["priority"] <= 100:
                raise ValueError(f"messages[{i}]: priority must be an integer 0..100")
            item["priority"] = m["priority"]
        out.append(item)
    if for_reply and out[-1]["role"] != "user":
        raise ValueError("messages: the last message must be from the user")
    return out


def plain_prompt(messages: Sequence[dict[str, str]]) -> str:
    """The fallback template for models without a chat template."""
    parts = [f"{_PLAIN_NAMES[m['role']]}: {m['content'].strip()}\n\n" for m in messages]
    return "".join(parts) + "Assistant:"


def render_chat(tokenizer, messages: Sequence[dict[str, Any]], for_reply: bool = True, model: str = "") -> list[int]:
    """Token ids of the whole conversation, ready for the assistant's reply (``for_reply``), or as a
    prefix of a longer chat (no generation prompt: used to find where each message ends). ``model`` names the
    model in the one line of a template that refuses the chat or goes past a render's bounds."""
    messages = validate_messages(messages, for_reply)
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        from engine.model import template_guard

        template_guard.install()  # rendered within bounds: output, loop steps, time
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=for_reply, tokenize=True)
        except template_guard.TemplateLimitError as e:
            raise ValueError(f"the chat template of {model or 'the model'} went past a render's bounds: {e}") from None
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError: the template refuses these messages
            if type(e).__module__.split(".")[0] != "jinja2":
                raise
            raise ValueError(f"the chat template of {model or 'the model'} refused these messages: {e}") from None
        if hasattr(ids, "keys"):  # BatchEncoding / dict in transformers 5
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]
    text = plain_prompt(messages) if for_reply else "".join(
        f"{_PLAIN_NAMES[m['role']]}: {m['content'].strip()}\n\n" for m in messages)
    return [int(t) for t in tokenizer(text)["input_ids"]]


def message_at(end: Callable[[int], int], count: int, pos: int) -> int:
    """Index of the message token ``pos`` of a rendered chat falls in, by bisecting its rendered prefixes (a few
    renders, not one per message): ``end(i)`` is the rendered length of ``messages[:i + 1]`` (the caller's render,
    cached as it likes); ``count`` (after all ``count`` messages): the reply's header."""
    lo, hi = 0, count  # the first message whose end is past pos
    while lo < hi:
        mid = (lo + hi) // 2
        if end(mid) > pos:
            hi = mid
        else:
            lo = mid + 1
    return lo


def last_message_at(tokenizer, messages: Sequence[dict[str, Any]], n: int, fresh_n: int) -> int:
    """Where the last message starts in a prompt of ``n`` ids whose fresh render had ``fresh_n`` (the reply splice,
    ``engine.model.splice``, changes only what comes before it: the tail is the fresh render's), or -1 for a
    single message. A branch or another second message goes on from there."""
    if len(messages) < 2:
        return -1
    at = n - (fresh_n - len(render_chat(tokenizer, messages[:-1], for_reply=False)))
    return at if 0 < at < n else -1


def message_spans(tokenizer, messages: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """Token range ``[start, end)`` of each message in the rendered chat (ends found by rendering prefixes)."""
    spans, start = [], 0
    for i in range(len(messages)):
        end = len(render_chat(tokenizer, messages[: i + 1], for_reply=False))
        spans.append((start, max(start, end)))
        start = max(start, end)
    return spans


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Raw completion: tokenized as the tokenizer does by default (BOS if it adds one)."""
    check_text(text, "prompt")
    return [int(t) for t in tokenizer(text)["input_ids"]]


_BYTE_TOKENS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def byte_tokens(tokenizer) -> dict[int, int]:
    """id -> byte of a byte-fallback vocabulary's byte tokens (``<0x41>``: Llama 2, Mistral, Gemma's sentencepiece
    models); empty for byte-level BPE (GPT-2, Llama 3, Qwen), whose every token is bytes. Once per tokenizer."""
    try:
        return _BYTE_TOKENS[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = {} if _no_byte_fallback(tokenizer) else {
        i: int(t[3:5], 16) for t, i in tokenizer.get_vocab().items()
        if len(t) == 6 and t.startswith("<0x") and t[5] == ">" and all(c in "0123456789ABCDEFabcdef" for c in t[3:5])}
    try:
        _BYTE_TOKENS[tokenizer] = ids
    except TypeError:
        pass
    return ids


def _no_byte_fallback(tokenizer) -> bool:
    """True when the tokenizer's decoder (``tokenizers``') turns no ``<0x41>`` token into its byte — a byte-level
    vocabulary's, which spells every token in bytes — so no token is held as a byte: its serialized decoder read
    (~0.1 ms) instead of the whole vocabulary (``get_vocab``: 0.1-0.25 s for Llama-3's 128,256 at a first reply)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # not a tokenizers tokenizer: its vocabulary is read
        return False
    if backend.decoder is None:
        return True  # no decoder: tokens are joined as they are spelled
    try:
        state = backend.decoder.__getstate__()
    except (AttributeError, TypeError, ValueError):
        return False
    return isinstance(state, bytes) and b"ByteFallback" not in state


CONTEXT_IDS = 5  # prompt ids a reply's first tokens are decoded after (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


class StreamDecoder:
    """Incremental detokenization that never emits half a UTF-8 character, and writes exactly the text a decode
    of the whole reply gives after ``context`` (the prompt's last ids: a reply's leading space is kept).

    Decodes a short window of ids (vLLM's prefix/read offsets): the text of ``ids[prefix:]`` minus the
    text of ``ids[prefix:read]`` is new. Only its end is held back while it is U+FFFD (an incomplete byte
    sequence: up to 3 bytes of a character) and released once the next token completes it; the text before
    goes out at once, so a stream of byte tokens is not held until the reply ends. A byte-fallback run
    (``<0x73><0x1D><0xBF>…``) is held until a token that is not a byte ends it: the tokenizer decodes a run that
    is not valid UTF-8 as one U+FFFD per byte, its valid start included, so text sent early ("s\x1d") would differ
    from the reply's text as the chat template renders it again — and the next turn's prompt would leave the
    cache there (``engine.model.splice``).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self._byte_ids = byte_tokens(tokenizer)
        # The prompt's last ids, read but never written (vLLM's prefix offset): the reply's first token is decoded
        # after them, as it sits in the chat. Decoded alone, a SentencePiece token "▁Hello" loses its space ("Hello"),
        # the chat template then renders "\nHello", which tokenizes to other ids, and the next turn recomputed the
        # whole reply (Phi-3's tokenizer: 27-65% of the previous prompt + reply reused).
        tail = list(context)
        self.ids: list[int] = [int(i) for i in tail[max(0, len(tail) - CONTEXT_IDS):]]  # the window's ids (``_trim``)
        self._prefix = 0
        self._read = len(self.ids)
        self._sent = 0  # characters past the prefix's text already handed out while the window's end was held
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        run = len(self.ids)  # where a byte-fallback run at the end starts
        while run > self._read and self.ids[run - 1] in self._byte_ids:
            run -= 1
        held = run < len(self.ids) or new_text.endswith("\ufffd")
        if run < len(self.ids):  # the text before the run only: the run's is known when it ends
            new_text = self._decode(self.ids[self._prefix:run])
        ready = new_text.rstrip("\ufffd") if held else new_text
        start = len(prefix_text) + self._sent
        delta = ready[start:] if len(ready) > start else ""
        if not held and len(new_text) > len(prefix_text):
            self._prefix, self._read, self._sent = self._read, len(self.ids), 0
            self._trim()
        else:
            self._sent += len(delta)
        self.text += delta
        return delta

    def _trim(self) -> None:
        """Forget the ids before the window: they are never decoded again, and a 120k-token reply kept a
        second list of all its ids here (~11 B per token). Done every 64 tokens, so the cost stays O(1) each."""
        if self._prefix >= 64:
            del self.ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def flush(self) -> str:
        """Whatever is still held back (at the end of a reply), replacement characters included."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        start = len(prefix_text) + self._sent
        delta = new_text[start:] if len(new_text) > start else ""
        self._prefix = self._read = len(self.ids)
        self._sent = 0
        self.text += delta
        return delta
