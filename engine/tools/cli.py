"""``python -m engine generate|bench|quality|fidelity|serve|attach|models``: the commands.

A bad input exits non-zero with a one-line reason on stderr and no traceback (set KVSCOPE_DEBUG=1 to see
one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from engine.config import SamplingConfig
from engine.errors import EngineError
from engine.tools.arguments import check_disk_budget, check_output_path, read_messages
from engine.tools.cli_flags import (EXIT_BAD_INPUT, EXIT_FAILED, build_parser, cache_config_from_args,
                                    model_spec_from_args)


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
    spec = model_spec_from_args(a)
    from engine.model.model_files import preflight

    preflight(spec)  # a bad model file's one line before torch is imported
    from engine.server.service import serve

    return serve(a, cache, spec)


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
    spec = model_spec_from_args(a)
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

            return run_fidelity(a, cache_config_from_args, model_spec_from_args)
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
