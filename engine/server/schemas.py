"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, checked into a ``GenRequest``.

Only what the engine can honour is accepted: one choice (``n`` 1), text content, the roles system /
developer (taken as system) / user / assistant / tool. Agents' fields — ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``response_format`` and the messages carrying calls and their results — are checked in
``engine.server.tool_request``. Fields OpenAI clients send that change nothing here (``user``, ``logit_bias``
empty, ...) are ignored; a field given with the wrong type is a 400 naming it, and so is one asking for what the
engine cannot do (``refuse_unsupported``): a non-empty ``logit_bias``, completions' ``echo`` / ``suffix`` /
``best_of``. ``logprobs`` / ``top_logprobs`` and ``presence_penalty`` / ``frequency_penalty`` are honoured, and so
are vLLM's sampling extensions the engine has: ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos``, ``min_tokens`` (benchmark clients send the last two to get replies of an exact length) and
``include_stop_str_in_output``; vLLM's that it has not (guided decoding, beam search, allowed or banned tokens,
prompt logprobs, a request's chat template, ...) are a 400 naming them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from engine.server.errors import ApiError, bad_request
from engine.server.tool_request import (chat_messages, parse_parallel, parse_response_format, parse_tool_choice,
                                        parse_tools)

MAX_STOP = 4
# vLLM's request fields for what this engine does not do: a 400 naming them, never ignored
VLLM_UNSUPPORTED = (("guided_json", "guided decoding"), ("guided_regex", "guided decoding"),
                    ("guided_choice", "guided decoding"), ("guided_grammar", "guided decoding"),
                    ("structured_outputs", "structured outputs"), ("use_beam_search", "beam search"),
                    ("allowed_token_ids", "allowed_token_ids"), ("bad_words", "bad_words"),
                    ("logits_processors", "logits processors"), ("prompt_logprobs", "prompt logprobs"),
                    ("chat_template", "a chat template from the request"),
                    ("chat_template_kwargs", "chat template arguments"),
                    ("truncate_prompt_tokens", "truncating the prompt"))
# ... and those the engine does only as their default does
VLLM_DEFAULTS_ONLY = (("skip_special_tokens", True, "skip_special_tokens false (special tokens in the text)"),
                      ("spaces_between_special_tokens", True, "spaces_between_special_tokens false"),
                      ("add_generation_prompt", True, "add_generation_prompt false"),
                      ("continue_final_message", False, "continue_final_message (going on with the last message)"))


@dataclass(frozen=True)
class GenRequest:
    """One generation request, checked. ``messages`` for chat, ``prompt`` (text) or ``prompt_ids`` otherwise."""

    kind: str  # "chat" | "completion"
    model: str
    messages: tuple[dict, ...] = ()
    prompt: str | None = None
    prompt_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token to report (0: the chosen token's only); None: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0  # vLLM's extensions (0 / -1: off)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop sequence, not before it
    cache_salt: str | None = None  # requests share cached prefixes only with the same salt (and API key)
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and each chunk's token_ids in the reply
    tools: tuple[dict, ...] = ()  # function tools, checked (``engine.server.tool_request``)
    tool_choice: str = "none"  # auto | none | required | the name of the function to call
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # None (text), {"type": "json_object"} or {"type": "json_schema", ...}


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (400 when it is not one)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"{name}: {v!r} is not a number", name, "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_request(f"{name}: {v} is outside {rng}", name, "invalid_value")
    return float(v)


def _int(body: dict, name: str, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{name}: {v!r} is not an integer", name, "invalid_type")
    if lo is not None and v < lo:
        raise bad_request(f"{name}: {v} must be at least {lo}", name, "invalid_value")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("stop: expected a string or a list of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP:
        raise bad_request(f"stop: at most {MAX_STOP} sequences ({len(items)} given)", "stop", "invalid_value")
    if any(s == "" for s in items):
        raise bad_request("stop: empty stop sequence", "stop", "invalid_value")
    return tuple(dict.fromkeys(items))


def _common(body: dict, kind: str) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: required (a string, see GET /v1/models)", "model",
                          "missing_required_parameter" if model is None else "invalid_type")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad_request(f"n: only 1 choice per request is supported ({n!r} given)", "n", "invalid_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream: {stream!r} is not a boolean", "stream", "invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad_request("stream_options: expected an object", "stream_options", "invalid_type")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("cache_salt: expected a non-empty string", "cache_salt", "invalid_type")
    mct = _int(body, "max_completion_tokens", 1)
    mt = _int(body, "max_tokens", 1)
    refuse_unsupported(body, kind)
    return dict(**_extensions(body, mct if mct is not None else mt),
                kind=kind, model=model, stream=stream, include_usage=bool(opts.get("include_usage")),
                logprobs=_logprobs(body, kind), presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                max_tokens=mct if mct is not None else mt,
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                seed=_int(body, "seed"), stop=_stop(body), cache_salt=salt,
                return_token_ids=bool(body.get("return_token_ids")), response_format=parse_response_format(body))


def _extensions(body: dict, max_tokens: int | None) -> dict[str, Any]:
    """vLLM's sampling parameters beyond OpenAI's, with vLLM's ranges (``top_k`` -1 is off, as 0 is)."""
    top_k = _int(body, "top_k", -1)
    min_tokens = _int(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens: {min_tokens} is above max_tokens ({max_tokens})", "min_tokens",
                          "invalid_value")
    ignore_eos = body.get("ignore_eos", False)
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise bad_request(f"ignore_eos: {ignore_eos!r} is not a boolean", "ignore_eos", "invalid_type")
    rep = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    if min_p == 1.0:
        raise bad_request("min_p: 1.0 is outside [0.0, 1.0)", "min_p", "invalid_value")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad_request("stop_token_ids: expected a list of token ids (integers >= 0)", "stop_token_ids",
                          "invalid_type")
    keep = body.get("include_stop_str_in_output", False)
    if keep is not None and not isinstance(keep, bool):
        raise bad_request(f"include_stop_str_in_output: {keep!r} is not a boolean", "include_stop_str_in_output",
                          "invalid_type")
    return dict(top_k=max(0, top_k or 0), min_p=min_p, repetition_penalty=rep, ignore_eos=bool(ignore_eos),
                min_tokens=min_tokens, stop_token_ids=tuple(dict.fromkeys(ids)), include_stop_str_in_output=bool(keep))


def _logprobs(body: dict, kind: str) -> int | None:
    """Alternatives per token to report, or None. Chat: ``logprobs`` true with ``top_logprobs`` 0..20;
    completions: ``logprobs`` 0..5 (OpenAI's ranges)."""
    if kind == "completion":
        n = _int(body, "logprobs", 0)
        if n is not None and n > 5:
            raise bad_request(f"logprobs: {n} is above 5 (the most alternatives per token)", "logprobs",
                              "invalid_value")
        return n
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad_request(f"logprobs: {on!r} is not a boolean", "logprobs", "invalid_type")
    top = _int(body, "top_logprobs", 0)
    if top is not None and top > 20:
        raise bad_request(f"top_logprobs: {top} is above 20", "top_logprobs", "invalid_value")
    if top is not None and not on:
        raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs", "invalid_value")
    return (top or 0) if on else None


def refuse_unsupported(body: dict, kind: str) -> None:
    """400 naming the first parameter that asks for what this engine cannot do (never answered and ignored)."""
    def no(param: str, why: str) -> ApiError:
        return bad_request(f"{param}: {why} is not supported by this server", param, "unsupported_parameter")

    if body.get("logit_bias"):
        raise no("logit_bias", "a non-empty logit_bias")
    for param, why in VLLM_UNSUPPORTED:
        v = body.get(param)
        if not (v is None or v is False or v == [] or v == {}):  # 0 asks too (prompt_logprobs 0)
            raise no(param, why)
    for param, default, why in VLLM_DEFAULTS_ONLY:
        v = body.get(param)
        if v is not None and v != default:
            raise no(param, why)
    if kind == "completion":
        if body.get("echo"):
            raise no("echo", "echo (the prompt in the reply)")
        if body.get("suffix"):
            raise no("suffix", "suffix (text after the completion)")
        best_of = body.get("best_of")
        if best_of is not None and (isinstance(best_of, bool) or best_of != 1):
            raise no("best_of", f"best_of {best_of!r} (one candidate per request)")


def parse_chat(body: dict[str, Any]) -> GenRequest:
    common = _common(body, "chat")
    if "messages" not in body:
        raise bad_request("messages: required (a list of {role, content})", "messages", "missing_required_parameter")
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages: expected a non-empty list of {role, content}", "messages", "invalid_value")
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    if choice != "none" and common["response_format"] is not None:
        raise bad_request("response_format: give it or a tool the model must call, not both (tool_choice "
                          f"{choice!r})", "response_format", "invalid_value")
    return GenRequest(messages=tuple(chat_messages(msgs)), tools=tools, tool_choice=choice,
                      parallel_tool_calls=parse_parallel(body), **common)


def parse_completion(body: dict[str, Any]) -> GenRequest:
    common = _common(body, "completion")
    if "prompt" not in body:
        raise bad_request("prompt: required (a string)", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list
    if isinstance(p, str):
        if not p:
            raise bad_request("prompt: empty (nothing to complete)", "prompt", "invalid_value")
        return GenRequest(prompt=p, **common)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        return GenRequest(prompt_ids=tuple(p), **common)
    if isinstance(p, list) and not p:
        raise bad_request("prompt: empty (nothing to complete)", "prompt", "invalid_value")
    if isinstance(p, list) and all(isinstance(x, (str, list)) for x in p):
        raise bad_request(f"prompt: one prompt per request ({len(p)} given)", "prompt", "invalid_value")
    raise bad_request("prompt: expected a string or a list of token ids", "prompt", "invalid_type")


def check_model(req: GenRequest, served: tuple[str, ...]) -> None:
    """404 unless ``req.model`` names the served model."""
    if req.model not in served:
        raise ApiError(404, f"The model `{req.model}` does not exist: this server serves `{served[0]}`",
                       "invalid_request_error", "model", "model_not_found")
