"""Decoding under a grammar: every token a constrained reply chooses is one the grammar allows.

The grammar library is llguidance (the Rust matcher vLLM, SGLang and Mistral's own tooling use too). Against
xgrammar on 2 shared cores, Qwen2.5's 151,665 tokens, 50 JSON schemas (``tests/engine/measure_grammar.py``, two
runs): a schema compiled in 0.9-1.1 ms median against 38-41 ms, so no request waits on a compile; a token's mask
37-49 us median, 450-500 us mean, against 3 and 21-25 us (xgrammar precomputes masks as it compiles) — hidden here
by computing the mask on a worker thread while the forward runs (``GrammarState``). Its Lark takes JSON schemas
inside text (``%json``) and special tokens by id (``<[id]>``), which the tool-call formats need; one wheel, no
dependencies.

``Grammar`` is compiled once per request, off the engine thread (``compile_json_schema`` / ``compile_lark``: a
schema the library refuses is a ``ValueError`` naming it); ``Sampler`` (``engine.core.sampling``) asks it for a
``GrammarState`` per reply and applies its mask in ``processed`` — the one place every path (eager, compiled,
batched, a verification's positions) takes its logits through — and advances it with each chosen token. A
speculative draft is cut to the tokens the grammar allows before it is verified (``valid_prefix``).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import weakref
from typing import Any, Sequence

import numpy as np
import torch

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
MAX_GRAMMAR_CHARS = 1 << 20  # a schema or grammar text beyond 1 MB is refused before the library sees it
# over every constrained reply of the process: tokens, seconds computing masks, seconds the sampler waited (tools)
TOTALS = {"tokens": 0, "mask_s": 0.0, "wait_s": 0.0}


def _ll():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ValueError("structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance


def ll_tokenizer(tokenizer, n_vocab: int, stop_ids: Sequence[int]):
    """llguidance's view of ``tokenizer`` (built once per tokenizer and vocabulary size: ~1 s for 150k tokens):
    ``n_vocab`` the model's logits (often padded past the tokenizer), ``stop_ids`` the tokens that end a reply
    (allowed where the grammar is complete)."""
    key = (n_vocab, tuple(sorted(set(stop_ids))))
    with _LOCK:
        per = _TOKENIZERS.get(tokenizer)
        if per is None:
            per = {}
            _TOKENIZERS[tokenizer] = per
        if key not in per:
            from llguidance.hf import from_tokenizer

            eos = list(key[1]) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
            per[key] = from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos[0] if len(eos) == 1 else eos)
        return per[key]


class Grammar:
    """A compiled grammar for one request; ``start()`` gives each reply its own state (the first one reuses the
    matcher made at compile time)."""

    def __init__(self, matcher, n_vocab: int, stop_ids: Sequence[int], label: str) -> None:
        self._pristine = matcher
        self._first = matcher.deep_copy()
        self.n_vocab = n_vocab
        self.stop_ids = tuple(sorted(set(stop_ids)))
        self.label = label  # what it constrains ("json_schema", "a call of get_weather", ...)

    def start(self) -> "GrammarState":
        m, self._first = (self._first, None) if self._first is not None else (self._pristine.deep_copy(), None)
        return GrammarState(m, self.n_vocab, self.stop_ids)


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvscope-grammar")
        return _POOL


class GrammarState:
    """One reply's place in the grammar: ``allowed()`` the tokens it may take now, ``accept(token)`` after each.

    The next mask is computed on a worker thread from the moment a token is accepted, while the model's forward
    for that token runs (llguidance lets go of the GIL): ``allowed()`` then only waits for what is left of it."""

    def __init__(self, matcher, n_vocab: int, stop_ids: tuple[int, ...]) -> None:
        self.m = matcher
        self.n_vocab = n_vocab
        self.stop_ids = stop_ids
        self.tokens = 0  # tokens accepted (the cost measure's denominator)
        self.mask_s = 0.0  # seconds spent computing masks (on the worker thread or not)
        self.wait_s = 0.0  # seconds the sampler waited for them
        self._next: concurrent.futures.Future | None = None

    def _mask(self) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.m.is_error():
            raise ValueError(f"the grammar failed: {self.m.get_error()}")
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.n_vocab].view(np.bool_)  # [n_vocab]
        out = torch.from_numpy(allowed.copy())
        if self.m.is_accepting():
            out[list(self.stop_ids)] = True
        dt = time.perf_counter() - t0
        self.mask_s += dt
        TOTALS["mask_s"] += dt
        return out

    def allowed(self) -> torch.Tensor:
        """[n_vocab] bool: the tokens the grammar allows next (the stop tokens where it is complete)."""
        t0 = time.perf_counter()
        fut, self._next = self._next, None
        out = fut.result() if fut is not None else self._mask()
        dt = time.perf_counter() - t0
        self.wait_s += dt
        TOTALS["wait_s"] += dt
        return out

    def accept(self, token: int) -> None:
        if self._next is not None:  # a mask nobody asked for (the reply ended): finished before the matcher moves
            self._next.result()
            self._next = None
        if token in self.stop_ids or self.m.is_stopped():
            return
        if not self.m.consume_token(int(token)):
            raise ValueError(f"the grammar refused token {token}: {self.m.get_error()}")
        self.tokens += 1
        TOTALS["tokens"] += 1
        self._next = _pool().submit(self._mask)  # while the forward for this token runs

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a speculative draft) the grammar would take in order from here."""
        if self._next is not None:  # the matcher is not to be read while its mask is computed
            self._next.result()
        if not tokens or self.m.is_stopped():
            return 0
        return int(self.m.validate_tokens([int(t) for t in tokens]))


def _matcher(tokenizer, n_vocab: int, stop_ids: Sequence[int], grammar: str, what: str):
    ll = _ll()
    limits = ll.LLParserLimits(verbose_errors=False)  # a refusal names the schema's problem, not parser state
    tok = ll_tokenizer(tokenizer, n_vocab, stop_ids)
    m = ll.LLMatcher(tok, grammar, log_level=0, limits=limits)
    if m.is_error():
        raise ValueError(f"{what}: the grammar library refused it ({m.get_error().splitlines()[0][:300]})")
    return m


def compile_json_schema(tokenizer, n_vocab: int, stop_ids: Sequence[int], schema: Any, what: str,
                        label: str = "json_schema") -> Grammar:
    """A grammar for JSON text that validates against ``schema`` (a dict; ``{"type": "object"}`` for any object).
    ``ValueError`` naming ``what`` when the library refuses it."""
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{what}: the schema is {len(text)} characters (at most {MAX_GRAMMAR_CHARS})")
    try:
        grammar = _ll().LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    except ValueError as e:
        raise ValueError(f"{what}: not a JSON schema the grammar library takes ({str(e).splitlines()[0][:300]})") \
            from None
    return Grammar(_matcher(tokenizer, n_vocab, stop_ids, grammar, what), n_vocab, stop_ids, label)


def compile_lark(tokenizer, n_vocab: int, stop_ids: Sequence[int], lark: str, what: str, label: str) -> Grammar:
    """A grammar from Lark text (llguidance's dialect: ``%json {...}`` for a JSON schema inside)."""
    if len(lark) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{what}: the grammar is {len(lark)} characters (at most {MAX_GRAMMAR_CHARS})")
    grammar = _ll().LLMatcher.grammar_from_lark(lark)
    return Grammar(_matcher(tokenizer, n_vocab, stop_ids, grammar, what), n_vocab, stop_ids, label)
