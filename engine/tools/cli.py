"""``python -m engine generate|bench|quality|fidelity|serve|attach|models`` (DESIGN.md §3).

A bad input exits non-zero with a one-line reason on stderr and no traceback (set KVSCOPE_DEBUG=1 to see
one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from engine.config import (CACHE_MODES, DEVICES, K_DTYPES, KV_DTYPES, OVERFLOWS, QUANTIZATIONS, CacheConfig, ModelSpec,
                           SamplingConfig, value_dtype)
from engine.policies.base import config_from_flags
from engine.errors import EngineError
from engine.tools.arguments import check_disk_budget, check_output_path, read_messages

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default="paged", choices=CACHE_MODES, help="KV cache mode (default paged)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page, 1..256 (default 16)")
    p.add_argument("--no-prefix-reuse", action="store_true", help="re-prefill every turn from scratch")
    p.add_argument("--checkpoints", type=int, default=8, metavar="N",
                   help="positions per chat a hybrid / sliding-window model's cache can go back to, 0..64 (default 8)")
    p.add_argument("--kv-dtype", default="auto", choices=K_DTYPES,
                   help="K and V precision (tqN-qjl: keys tqN-qjl, values tqN)")
    p.add_argument("--k-dtype", default=None, choices=K_DTYPES, help="K precision (overrides --kv-dtype)")
    p.add_argument("--v-dtype", default=None, choices=KV_DTYPES, help="V precision (overrides --kv-dtype)")
    _policy_args(p)
    p.add_argument("--overflow", default="stop", choices=OVERFLOWS, help="what happens when the context is full")
    p.add_argument("--kv-disk", default="off", metavar="DIR|off", help="keep full pages on disk in DIR (engine.kv.tier.disk)")
    p.add_argument("--kv-disk-budget", type=float, default=None, metavar="GB", help="its size limit in GiB (default 4)")


def _policy_args(p: argparse.ArgumentParser) -> None:
    """``--policy`` and the policy flags, as the policy classes declare them (``Params`` ``flag`` metadata)."""
    from engine.policies import policy_flags, policy_names

    p.add_argument("--policy", default="none", choices=policy_names(), help="eviction policy")
    for flag, texts in policy_flags().items():
        p.add_argument(f"--{flag}", type=int, default=None, help="; ".join(texts))


def policy_flag_values(a: argparse.Namespace) -> dict[str, Any]:
    """The policy flags given on the command line (None where not given)."""
    from engine.policies import policy_flags

    return {flag: getattr(a, flag, None) for flag in policy_flags()}


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default="none", choices=QUANTIZATIONS, help="bitsandbytes weights")
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--allow-pickle", action="store_true", help="allow pickle (.bin) weights: can run code")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model repository's own code")
    p.add_argument("--offline", action="store_true", help="never download")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (no usage dump), exit code 2."""

    def error(self, message: str):  # noqa: D401
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine", description="KV Scope engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text with the engine's KV cache")
    g.add_argument("--model", required=True, help="folder, hub id, or demo")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw completion prompt (no chat template)")
    src.add_argument("--messages", help="JSON file: a list of {role, content}; each user message is a turn")
    g.add_argument("--max-new-tokens", type=int, default=128)
    _cache_args(g)
    _model_args(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _spec_args(g)

    _bench_parser(sub)
    _serve_parser(sub)
    _attach_parser(sub)

    q = sub.add_parser("quality", help="score lossy cache settings against the full cache on one text")
    q.add_argument("--model", required=True, help="folder, hub id, or demo")
    q.add_argument("--text", help="UTF-8 text file (default: a built-in short story)")
    q.add_argument("--kv-dtype", default=None, choices=K_DTYPES, help="score only this K and V precision")
    q.add_argument("--k-dtype", default=None, choices=K_DTYPES)
    q.add_argument("--v-dtype", default=None, choices=KV_DTYPES)
    _policy_args(q)  # score only this policy
    q.add_argument("--page-size", type=int, default=16)
    q.add_argument("--device", default="auto", choices=DEVICES)
    q.add_argument("--json", dest="json_file", required=True, help="output file")

    from engine.tools.fidelity_report import add_parser as fidelity_parser

    fidelity_parser(sub, _cache_args, _model_args)
    from engine.tools.models import add_parser as models_parser

    models_parser(sub, _model_args)
    return parser


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default="off", metavar="off|ngram|draft:PATH",
                   help="speculative decoding: prompt lookup (ngram) or a draft model with the same tokenizer")
    p.add_argument("--draft-tokens", type=int, default=0, help="draft tokens per forward (0: adaptive)")


def _bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="speed against HF generate in the same run")
    m = b.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", help="folder, hub id, or demo")
    m.add_argument("--shape", help="random-weight model of a real config: smollm2-135m, qwen2.5-0.5b, ...")
    b.add_argument("--contexts", default="256,1024,2048", help="prompt lengths, comma separated")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--modes", default="hf-dynamic,hf-no-cache,off,contiguous,paged",
                   help="comma list of hf-dynamic, hf-no-cache, off, contiguous, paged, paged:KIND "
                        "(KIND int8, int4, tq4, tq3, tq2, tq3-qjl, ...: K and V)")
    b.add_argument("--page-size", type=int, default=16)
    b.add_argument("--repeats", type=int, default=1, help="round-robin repeats (median reported)")
    b.add_argument("--eager", action="store_true",
                   help="measure the engine without its compiled decode step (engine.model.fast_step)")
    b.add_argument("--reuse-history", type=int, default=0,
                   help="also measure a turn's TTFT with prefix reuse vs a full re-prefill at this history length")
    b.add_argument("--long", type=int, default=0, help="also run one generation of this many tokens per mode")
    b.add_argument("--concurrency", default="", metavar="N,M",
                   help="also run N (then M...) sessions generating at once, decoded together: aggregate tokens/s")
    b.add_argument("--prefix-cache", type=int, default=0, metavar="N",
                   help="also run N requests sharing one system prompt (automatic prefix caching)")
    b.add_argument("--shared-prompt", type=int, default=1000, help="tokens of that system prompt")
    b.add_argument("--kv-disk", default="off", metavar="DIR|off", help="--scenario reopen: the disk tier's folder "
                   "(default: a temporary one, removed after)")
    b.add_argument("--scenario", default="", choices=("", "mixed", "copy", "reopen", "branch"),
                   help="mixed: an app-style chat message sent while 4 API streams decode, TTFT against idle; "
                   "copy: a passage of the model's own text, then its opening again (prompt lookup's best case); "
                   "reopen: a chat written, then reopened in a new process from the KV disk tier vs prefilled")
    _spec_args(b)
    b.add_argument("--server", action="store_true",
                   help="also measure decode tokens/s through the OpenAI API against the engine (needs a tokenizer)")
    b.add_argument("--device", default="auto", choices=DEVICES)
    b.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="weights and KV dtype (auto: float32 for --shape, the checkpoint's for --model)")
    b.add_argument("--json", dest="json_file", required=True, help="output file")


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the model with the OpenAI API (chat and text completions)")
    s.add_argument("--model", required=True, help="folder, hub id, or demo")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other "
                   "needs --api-key)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    s.add_argument("--api-key", action="append", default=None, help="require 'Authorization: Bearer KEY' (or set "
                   "KVSCOPE_API_KEY); repeatable: each key a tenant whose cached prompts the others cannot reach")
    s.add_argument("--cors", action="append", metavar="ORIGIN", help="allow browser requests from this origin "
                   "(repeatable; default: none)")
    s.add_argument("--max-running", type=int, default=16,
                   help="requests generated in turn, decoded together (default 16: one batched forward)")
    s.add_argument("--max-queued", type=int, default=32, help="requests waiting beyond those; more get 429")
    s.add_argument("--max-idle", type=int, default=4, help="finished conversations kept with their cache")
    s.add_argument("--max-body", type=int, default=4 << 20, help="largest request body in bytes; larger get 413")
    s.add_argument("--max-tokens", type=int, default=4096, help="most tokens one reply may generate (default 4096; "
                   "a larger max_tokens gets 400, none asked: this many at most)")
    s.add_argument("--max-connections", type=int, default=512, help="open connections; more get 503 (default 512)")
    s.add_argument("--header-timeout", type=float, default=10.0, help="seconds for a request's head (default 10)")
    s.add_argument("--body-timeout", type=float, default=30.0, help="seconds for a request's body (default 30)")
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.add_argument("--kv-events-config", metavar="JSON", help="publish KV cache events as vLLM does, e.g. "
                   '\'{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:5557"}\' (the default '
                   "endpoint; answered at /kv_event_sources). With --api-key, or for a request with cache_salt, "
                   "the events carry block hashes only, never token ids")
    s.add_argument("--kv-events-allow-remote", action="store_true", help="let the events and replay endpoints be "
                   "reachable from other machines (tcp://*:PORT, a LAN address): anyone who reaches them, with no "
                   "key, sees when blocks are cached and evicted and, on a server without --api-key, the token ids "
                   "of every unsalted prompt and reply")
    s.add_argument("--metrics-public", action="store_true", help="with --api-key, answer /metrics (and /health's "
                   "queue lengths) without a key too: request and token counts tell one tenant when another is "
                   "busy. /health's status is always open")
    _spec_args(s)
    _cache_args(s)
    _model_args(s)


def _attach_parser(sub) -> None:
    t = sub.add_parser("attach", help="chat with (or watch) a remote OpenAI-compatible server such as vLLM and report "
                       "its KV cache from its KV events and /metrics")
    t.add_argument("url", help="the server, http(s)://HOST:PORT")
    t.add_argument("--api-key", default=None, help="its API key (Authorization: Bearer)")
    t.add_argument("--model", default=None, help="which of the models it serves to chat with (default: its first)")
    t.add_argument("--events", default=None, metavar="ENDPOINT", help="KV events endpoint when the server's "
                   "/kv_event_sources does not say (tcp://HOST:PORT; vLLM's rule: a publisher on tcp://*:PORT binds)")
    src = t.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one user message to send")
    src.add_argument("--messages", help="JSON file: a list of {role, content}")
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="also watch the events this long")
    t.add_argument("--events-timeout", type=float, default=5.0, help="seconds to wait for a first KV event batch")
    t.add_argument("--json", action="store_true", help="print one JSON object")


def _model_spec(a: argparse.Namespace) -> ModelSpec:
    return ModelSpec(source=a.model, quantization=a.quantize, device=a.device, dtype=a.dtype,
                     allow_pickle=a.allow_pickle, trust_remote_code=a.trust_remote_code,
                     allow_download=not a.offline)


def cmd_serve(a: argparse.Namespace) -> int:
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port {a.port} is outside 0..65535")
    for name in ("max_running", "max_idle", "max_body", "max_tokens", "max_connections"):
        if getattr(a, name) < (1 if name != "max_idle" else 0):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)} is too small")
    for name in ("header_timeout", "body_timeout"):
        if not getattr(a, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)} must be more than 0 seconds")
    if a.max_queued < 0:
        raise ValueError(f"--max-queued {a.max_queued} must be at least 0")
    cache = cache_config_from_args(a)
    spec = _model_spec(a)
    from engine.model.model_files import preflight

    preflight(spec)  # a bad model file's one line before torch is imported
    from engine.server.service import serve

    return serve(a, cache, spec)


def cache_config_from_args(a: argparse.Namespace) -> CacheConfig:
    """The ``CacheConfig`` of parsed cache flags (policy flags go where the policy's ``Params`` say)."""
    return config_from_flags(
        policy=a.policy,
        flags=policy_flag_values(a),
        mode=getattr(a, "cache", "paged"),
        page_size=a.page_size,
        prefix_reuse=not getattr(a, "no_prefix_reuse", False),
        k_dtype=a.k_dtype or a.kv_dtype,
        v_dtype=a.v_dtype or value_dtype(a.kv_dtype),
        overflow=getattr(a, "overflow", "stop"),
        checkpoints=getattr(a, "checkpoints", 8),
    )


def _turn_json(session, result, prompt_tokens: int, evictions: list[dict] | None = None) -> dict[str, Any]:
    st = result.stats
    snapshot = result.snapshot
    return {
        "evicted_tokens": sum(len(e["positions"]) for e in evictions or []),
        "evictions": evictions or [],
        "token_ids": session.generated_ids,
        "text": result.text,
        "prompt_tokens": prompt_tokens,
        "reused_tokens": st.reused_tokens,
        "disk_restored_tokens": st.disk_restored_tokens,
        "recomputed_tokens": st.recomputed_tokens,
        "first_divergence": st.first_divergence,
        "ttft_ms": round(st.ttft_ms, 3),
        "decode_tokens_per_s": round(st.decode_tokens_per_s, 3),
        "kv_bytes": snapshot.kv_bytes if snapshot else 0,
        "pages_used": int(snapshot.pages_used_per_layer[0]) if snapshot is not None and len(snapshot.pages_used_per_layer) else 0,
        "stop_reason": result.stop_reason,
        "warnings": list(result.warnings),
        "forwards": st.forwards,
        "speculative": st.speculative or None,
        "draft_tokens": st.draft_tokens,
        "accepted_draft_tokens": st.accepted_draft_tokens,
        "accepted_by_position": list(st.accepted_by_position),
        # why each prompt token was reused or computed (``engine.snapshot.CacheAccount``), as the API tells it
        "cache": st.cache.to_dict() if st.cache is not None else None,
    }


def cmd_generate(a: argparse.Namespace) -> int:
    cache = cache_config_from_args(a)
    sampling = SamplingConfig(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, seed=a.seed, max_new_tokens=a.max_new_tokens,
        ignore_eos=a.ignore_eos,
    )
    spec = _model_spec(a)
    messages = read_messages(a.messages) if a.messages is not None else None  # before torch is imported
    from engine.model.model_files import preflight

    preflight(spec)  # a bad model file's one line before torch is imported too
    if a.prompt is not None:
        from engine.model.chat import check_text

        check_text(a.prompt, "prompt")  # before the model loads
        if not a.prompt:  # the API's 400; stories260K 'completed' its BOS alone, the demo failed after loading
            raise ValueError("prompt: empty (nothing to complete)")
    from engine.core.verify import SpecConfig

    spec_cfg = SpecConfig.parse(a.speculative, a.draft_tokens)  # a bad flag: exit 2 before the model loads
    from engine.kv.tier.disk import configure_flag
    from engine.model.loader import load_model
    from engine.core.session import ChatSession

    from engine.model.hf_load import print_notes

    lm = load_model(spec, print_notes)  # a GGUF's dequantization and its memory said before the weights load
    if lm.tokenizer is None:
        raise EngineError("this model has no tokenizer")
    configure_flag(lm, a)
    session = ChatSession(lm, cache)
    _speculate(session, spec_cfg, lm)
    if messages is None:
        stats = session.start_completion(a.prompt, sampling)
        r, evictions = _run_turn(session, a)
        if a.json:
            print(json.dumps(_turn_json(session, r, stats.prompt_tokens, evictions)))
        return 0
    turns = []
    history: list[dict] = []
    for i, m in enumerate(messages):
        history.append(m)
        if m["role"] != "user":
            continue
        stats = session.start(history, sampling)
        r, evictions = _run_turn(session, a)
        turns.append(_turn_json(session, r, stats.prompt_tokens, evictions))
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        if nxt is None or nxt["role"] != "assistant":
            history.append({"role": "assistant", "content": r.text})
    if a.json:
        print(json.dumps({"turns": turns}))
    return 0


def _speculate(session, cfg, lm) -> None:
    """Turn speculative decoding on as ``--speculative`` says (a draft model loaded and checked first)."""
    if cfg.method == "off":
        return
    from engine.speculation.draft_model import load_drafter

    session.speculate(cfg, load_drafter(cfg, lm))  # a draft model's load error names it


def _run_turn(session, a: argparse.Namespace) -> tuple[Any, list[dict]]:
    """Run one reply to its end through a core (``engine.core.scheduler.drive``), streaming text unless ``--json``;
    the last result and every eviction. What the engine tells the user (tokens dropped to fit the context, ...)
    goes to stderr as notes."""
    from engine.core.scheduler import drive

    evictions: list[dict] = []
    for r in drive(session):
        if r.snapshot is not None and r.snapshot.evicted_positions:
            evictions.append({"step": r.snapshot.step, "reason": r.snapshot.evict_reason,
                              "positions": list(r.snapshot.evicted_positions)})
        if not a.json and r.event is not None and r.event.text_delta:
            sys.stdout.write(r.event.text_delta)
            sys.stdout.flush()
    import dataclasses

    from engine.kv.tier.report import settled_notes

    late = settled_notes(session.lm)  # the disk writer's news of this reply's pages (a full disk), said with it
    if late:
        r = dataclasses.replace(r, warnings=tuple(r.warnings) + tuple(n for n in late if n not in r.warnings))
    if not a.json:
        sys.stdout.write("\n")
        for note in r.warnings:
            print(f"note: {note}", file=sys.stderr)
    if r.stats is not None and r.stats.spec_note:
        print(f"note: {r.stats.spec_note}", file=sys.stderr)
    return r, evictions


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    debug = os.environ.get("KVSCOPE_DEBUG") == "1"
    try:
        if a.command in ("bench", "quality"):
            check_output_path(a.json_file)
        check_disk_budget(getattr(a, "kv_disk_budget", None))  # generate and serve: before the model loads
        if a.command == "generate":
            return cmd_generate(a)
        if a.command == "serve":
            return cmd_serve(a)
        if a.command == "attach":
            from engine.remote.attach import run_attach

            return run_attach(a)
        if a.command == "bench":
            from engine.tools.bench import run_bench

            return run_bench(a)
        if a.command == "quality":
            from engine.tools.quality import run_quality

            return run_quality(a)
        if a.command == "fidelity":
            from engine.tools.fidelity_report import run_fidelity

            return run_fidelity(a, cache_config_from_args, _model_spec)
        if a.command == "models":
            from engine.tools.models import run_models

            return run_models(a)
        parser.error(f"unknown command {a.command}")
    except (EngineError, ValueError) as e:
        if debug:
            raise
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an engine bug: still one line, with the type, unless debugging
        if debug:
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        print(f"error: internal {type(e).__name__}: {msg} (KVSCOPE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_FAILED
    return 0
