"""A zoo model through our engine, judged against transformers: load (or refusal), greedy ids, chat, bytes.

Shared by ``arch_report.py`` (the table of every type) and ``test_arch_coverage.py`` (its regression guard), so
both judge a type the same way. The HF reference and the step loop are ``test_layer_kinds``'s own helpers (the
same ``generate`` call and the same session loop as the layer-kind tests), so "exact" means one thing in both.

A type is one of:

- ``exact``: greedy ids equal HF's ``generate`` in every cache mode (off, contiguous, paged 3, paged 16; float32),
  a second turn with prefix reuse gives the ids a re-prefilled second turn gives, and a chat stepped in turn
  with another chat on the same model still gives HF's ids (state kept outside the session would leak);
- ``refused``: loading says why in one line, as an ``EngineError`` (``wrap_model`` itself, or the model's
  ``unsupported`` reason that ``load_model`` and ``ChatSession`` raise);
- ``failing``: anything else (an internal error, another exception type, different ids): an engine bug.
"""

from __future__ import annotations

import traceback

import torch

from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.errors import EngineError
from engine.model.loaded import wrap_model
from engine.core.session import ChatSession
from test_layer_kinds import hf_greedy, run  # tests/engine is on sys.path (pytest, arch_report)

PROMPT_LEN = 12  # longer than the zoo's window (8): the prompt alone already slides
MODES: dict[str, CacheConfig] = {
    "off": CacheConfig(mode="off"),
    "contiguous": CacheConfig(mode="contiguous"),
    "paged3": CacheConfig(mode="paged", page_size=3),
    "paged16": CacheConfig(mode="paged", page_size=16),
}
CHAT = "chat"  # the two-turn check's key among the modes
TURN2 = [7, 9, 11, 13]  # the second turn's new "user message"
TWO_CHATS = "two_chats"  # two sessions on one model, stepped in turn
CHECKS = (*MODES, CHAT, TWO_CHATS)


def prompt(vocab_size: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (PROMPT_LEN,), generator=g).tolist()


def wrap(model, name: str):
    """Our ``LoadedModel`` around a zoo model, as ``load_model`` builds it after reading the weights."""
    return wrap_model(model, None, ModelSpec(source="zoo"), "cpu", "CPU", name=name, path=None, is_demo=True)


def load(model, name: str):
    """``(lm, None)`` for a model the engine accepts, ``(lm or None, reason)`` for one it refuses.

    The refusal is what a user gets from ``load_model`` / ``python -m engine generate``: ``wrap_model`` raising
    an ``EngineError`` (a model that fails its three-token probe), or ``info.unsupported``, which
    ``load_model`` and ``ChatSession`` raise as ``UnsupportedModelError``. Any other exception propagates:
    a crash while loading is a failure, not a refusal."""
    try:
        lm = wrap(model, name)
    except EngineError as e:
        return None, str(e)
    return lm, (lm.info.unsupported or None)


def greedy(lm, ids: list[int], n: int, cache: CacheConfig) -> list[int]:
    s = ChatSession(lm, cache)
    try:
        return run(s, ids, n)[0]
    finally:
        s.close()


def two_turns(lm, ids: list[int], n: int) -> dict:
    """A second turn that extends the first (its reply, then ``TURN2``), with prefix reuse and re-prefilled."""
    outs = []
    for reuse in (True, False):
        s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, prefix_reuse=reuse))
        try:
            first = run(s, ids, n)[0]
            second = run(s, ids + first[:-1] + TURN2, n)[0]
            outs.append((first + second, s.last_stats.reused_tokens))
        finally:
            s.close()
    (got, reused), (ref, _) = outs
    r = compare(ref, got)
    r["reused"] = reused
    return r


def two_chats(lm, ids: list[int], ref: list[int]) -> dict:
    """Two chats on one model stepped in turn (the app's session pool, a fork's parent going on): the first must
    still give HF's ids. A model that keeps state outside the cache (recurrent_gemma's module attributes)
    mixes the two."""
    a, b = (ChatSession(lm, CacheConfig(mode="paged", page_size=4)) for _ in range(2))
    try:
        a.start_ids(ids, SamplingConfig(max_new_tokens=len(ref), ignore_eos=True))
        b.start_ids(ids[::-1], SamplingConfig(max_new_tokens=len(ref), ignore_eos=True))
        done_a = done_b = False
        while not done_a:
            done_a = a.step().done
            if not done_b:
                done_b = b.step().done
        return compare(ref, a.generated_ids)
    finally:
        a.close()
        b.close()


def where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of the original exception (the cause of an engine error)."""
    root = exc.__cause__ or exc
    frames = traceback.extract_tb(root.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.split('site-packages/')[-1].split('/wt-zoo2/')[-1].split('/main/')[-1]}:{f.lineno}"


def describe_error(exc: BaseException) -> dict:
    root = exc.__cause__ or exc
    msg = str(root).splitlines()[0][:240] if str(root) else ""
    return {"status": "error", "error": type(root).__name__, "message": msg, "where": where(exc),
            "raised_as": type(exc).__name__}


def compare(ref: list[int], got: list[int]) -> dict:
    if got == ref:
        return {"status": "exact"}
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return {"status": "mismatch", "first_divergence": i, "hf": ref[i] if i < len(ref) else None,
            "engine": got[i] if i < len(got) else None, "engine_len": len(got)}


def margin(model, ids: list[int]) -> float:
    """HF's top-1 minus top-2 logit after ``ids``: near 0, a mismatch there may be a numeric tie, not a bug."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def run_modes(model, name: str, n: int, modes=CHECKS, stop_at_first_failure: bool = False) -> dict:
    """Load, then HF's ids, then every mode in ``modes``: each result exact / mismatch / error (never raises)."""
    result: dict = {}
    try:
        lm, reason = load(model, name)
    except Exception as e:  # noqa: BLE001 - the report records every failure
        result["load"] = describe_error(e)
        return result
    result["load"] = {"status": "refused", "reason": reason} if reason else {"status": "ok"}
    if lm is not None:
        result["info"] = info_row(lm.info)
    if not reason:
        result.update(run_loaded(model, lm, n, modes, stop_at_first_failure))
    return result


def run_loaded(model, lm, n: int, modes=CHECKS, stop_at_first_failure: bool = False) -> dict:
    """HF's ``n`` greedy ids, then ours in each of ``modes`` (``CHAT``: two turns of ``n // 2``; ``TWO_CHATS``:
    ``n // 2`` tokens)."""
    ids = prompt(model.config.get_text_config().vocab_size)
    result: dict = {"prompt": ids, "new_tokens": n}
    try:
        ref = hf_greedy(model, ids, n)
    except Exception as e:  # noqa: BLE001
        result["hf"] = describe_error(e)
        return result
    result["hf_distinct"] = len(set(ref))  # a near-constant reference would hide a broken cache
    result["modes"] = {}
    for label in modes:
        try:
            if label == CHAT:
                r = two_turns(lm, ids, n // 2)
            elif label == TWO_CHATS:
                r = two_chats(lm, ids, ref[:n // 2])  # greedy: the first n // 2 of HF's n ids
            else:
                r = compare(ref, greedy(lm, ids, n, MODES[label]))
        except Exception as e:  # noqa: BLE001
            r = describe_error(e)
        if r["status"] == "mismatch" and label in MODES:
            r["hf_margin"] = round(margin(model, ids + ref[:r["first_divergence"]]), 5)
        result["modes"][label] = r
        if stop_at_first_failure and r["status"] != "exact":
            break
    return result


def info_row(info) -> dict:
    """What the engine's ``ModelInfo`` says the model caches (for the report)."""
    return {"layer_kinds": list(info.layer_kinds), "windows": list(info.windows), "k": [info.k_heads, info.k_dim],
            "v": [info.v_heads, info.v_dim], "kv_bytes_per_token": info.kv_bytes_per_token,
            "state_bytes": info.state_bytes, "attn_impl": info.attn_impl, "summary": info.layer_summary}


def verdict(result: dict) -> str:
    """exact / refused / failing."""
    load_status = result.get("load", {}).get("status")
    if load_status == "refused":
        return "refused"
    modes = result.get("modes", {})
    if load_status == "ok" and "hf" not in result and modes and all(r["status"] == "exact" for r in modes.values()):
        return "exact"
    return "failing"


def failure(result: dict) -> str:
    """One line: the first failing stage and what went wrong."""
    for key in ("load", "hf"):
        r = result.get(key, {})
        if r.get("status") == "error":
            return f"{key}: {r['error']}: {r['message'][:160]} ({r['where']})"
    for mode, r in result.get("modes", {}).items():
        if r["status"] == "mismatch":
            m = f", HF margin {r['hf_margin']}" if "hf_margin" in r else ""
            return f"{mode}: greedy ids differ from HF's from new token {r['first_divergence']}{m}"
        if r["status"] == "error":
            return f"{mode}: {r['raised_as']} from {r['error']}: {r['message'][:160]} ({r['where']})"
    return ""


# -- KV bytes: what ModelInfo prices against what transformers' DynamicCache holds ---------------------------

def hf_cache_bytes(model, tokens: int) -> tuple[int, int]:
    """``(kv, state)``: bytes of the tensors in HF's ``DynamicCache`` after a ``tokens``-token forward: K and V as
    HF holds them (each layer's ``keys`` and ``values``), and conv / recurrent states."""
    from transformers import DynamicCache

    cfg = model.config.get_text_config()
    cache = DynamicCache(config=cfg)
    ids = (torch.arange(tokens) + 3)[None] % cfg.vocab_size
    with torch.inference_mode():
        model(input_ids=ids, position_ids=torch.arange(tokens)[None], cache=cache, use_cache=True)
    kv = sum(_nbytes(getattr(layer, n, None)) for layer in cache.layers for n in ("keys", "values"))
    state = sum(_nbytes(getattr(layer, n, None)) for layer in cache.layers for n in ("conv_states", "recurrent_states"))
    return kv, state


SHORT, LONG = 5, 20  # tokens: inside the zoo's window of 8 (HF holds every token), then past it


def bytes_row(model, info) -> dict:
    """The engine's prices (``ModelInfo``) next to what HF's cache holds.

    ``per_token``: [engine ``kv_bytes_per_token``, HF's K+V bytes after SHORT tokens / SHORT] (every layer still
    holds every token there); ``state``: [engine ``state_bytes``, HF's]; ``short`` / ``long``: [engine
    ``kv_bytes_at(t)``, HF's total] (past the window HF keeps ``window - 1`` tokens of a sliding layer)."""
    kv, state = hf_cache_bytes(model, SHORT)
    kv_long, state_long = hf_cache_bytes(model, LONG)
    return {"per_token": [info.kv_bytes_per_token, kv / SHORT], "state": [info.state_bytes, state],
            "short": [info.kv_bytes_at(SHORT), kv + state], "long": [info.kv_bytes_at(LONG), kv_long + state_long]}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0
