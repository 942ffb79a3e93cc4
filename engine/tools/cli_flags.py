"""The command line's flags: ``build_parser`` (every subcommand's arguments, a bad one said in one line, exit 2)
and the configs parsed flags make (``cache_config_from_args``, ``model_spec_from_args``). The commands that run
them are ``engine.tools.cli``'s.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.config import (CACHE_MODES, DEVICES, K_DTYPES, KV_DTYPES, OVERFLOWS, QUANTIZATIONS, CacheConfig, ModelSpec,
                           value_dtype)
from engine.policies.base import config_from_flags

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


def model_spec_from_args(a: argparse.Namespace) -> ModelSpec:
    """The ``ModelSpec`` of parsed model flags."""
    return ModelSpec(source=a.model, quantization=a.quantize, device=a.device, dtype=a.dtype,
                     allow_pickle=a.allow_pickle, trust_remote_code=a.trust_remote_code,
                     allow_download=not a.offline)


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
