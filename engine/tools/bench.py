"""``python -m engine bench``: the engine's cache modes against HF ``generate`` in the same process and run.

Rows: ``{engine, mode, context, new_tokens, ttft_ms, decode_tokens_per_s, kv_bytes}`` with engine "hf"
(mode "dynamic" = DynamicCache, "no_cache" = ``use_cache=False``) or "kvscope" (mode as ``--cache``).
TTFT is prompt prefill + first token; decode tok/s is tokens 2..N over their wall time. Modes run
round-robin per context so the ratios are side by side.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from engine.tools import bench_spec
from engine.config import K_DTYPES, CacheConfig, SamplingConfig, value_dtype
from engine.tools.arguments import write_json

HF_MODES = {"hf-dynamic": "dynamic", "hf-no-cache": "no_cache"}
ENGINE_MODES = ("off", "contiguous", "paged")


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


class _Clock:
    """A logits processor that stamps the time each token is chosen (HF calls it once per token)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:  # the stamp must follow the forward, not its launch (HF syncs once per step anyway)
            torch.cuda.synchronize(scores.device)
        self.stamps.append(time.perf_counter())
        return scores


def run_hf(lm, prompt: list[int], new_tokens: int, use_cache: bool) -> dict[str, Any]:
    from transformers import LogitsProcessorList

    model = lm.model
    ids = torch.tensor([prompt], device=lm.device)
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, use_cache=use_cache,
                             logits_processor=LogitsProcessorList([clock]), pad_token_id=0,
                             return_dict_in_generate=True)
    ttft = (clock.stamps[0] - t0) * 1000.0
    decode_s = clock.stamps[-1] - clock.stamps[0]
    kv = 0
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if use_cache and cache is not None:
        for layer in cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    kv += t.numel() * t.element_size()
    return {"ttft_ms": ttft, "decode_tokens_per_s": (len(clock.stamps) - 1) / decode_s if decode_s > 0 else 0.0,
            "kv_bytes": kv, "tokens": out.sequences.shape[1] - len(prompt)}


def run_engine(lm, prompt: list[int], new_tokens: int, cache: CacheConfig, a=None) -> dict[str, Any]:
    """One cold reply on the engine (``a``: the bench's flags, to speculate)."""
    from engine.tools import bench_spec
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession

    s = ChatSession(lm, cache.replace(prefix_reuse=False))  # a cold prefill: no pages of earlier repeats
    try:
        if a is not None:
            bench_spec.speculate(s, a, lm)
        s.start_ids(prompt, SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True))
        compiled = 0
        for r in drive(s):  # through a core, as the app's replies run (its stats time the same steps)
            compiled += r.event is not None and r.event.path == "compiled"
        st = r.stats
        out = {"ttft_ms": st.ttft_ms, "decode_tokens_per_s": st.decode_tokens_per_s,
               "kv_bytes": r.snapshot.kv_bytes, "tokens": st.generated_tokens, "compiled_tokens": compiled}
        if a is not None:
            out.update(bench_spec.fields(st, a.spec_cfg.label))
        return out
    finally:
        s.close()


def run_turn_reuse(lm, history: int, new_user: int, cache: CacheConfig) -> dict[str, float]:
    """TTFT of a turn after ``history`` cached tokens: prefix reuse vs a full re-prefill."""
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession

    base = _prompt(lm.info.vocab_size, history, seed=1)
    extra = _prompt(lm.info.vocab_size, new_user, seed=2)
    out = {}
    for reuse in (True, False):
        s = ChatSession(lm, cache.replace(prefix_reuse=reuse))
        try:
            s.start_ids(base, SamplingConfig(max_new_tokens=1, ignore_eos=True))
            for _ in drive(s):
                pass
            prev = s.seq[:-1]
            s.start_ids(prev + extra, SamplingConfig(max_new_tokens=1, ignore_eos=True))
            for r in drive(s):
                pass
            out["reuse" if reuse else "full"] = r.stats.ttft_ms
            out["reused_tokens" if reuse else "full_reused_tokens"] = r.stats.reused_tokens
        finally:
            s.close()
    return out


def _load(a):
    if a.shape:
        from engine.model.shapes import build_shape

        dtype = getattr(torch, a.dtype) if a.dtype != "auto" else torch.float32
        lm = build_shape(a.shape, device=a.device, dtype=dtype)
        if lm.info.device == "cpu":  # as a load says it: which native kernels are missing here, and what it costs
            from engine.model.linear_op import say_missing
            from engine.model.notes import print_notes

            say_missing(print_notes)
        return lm
    from engine.config import ModelSpec
    from engine.model.loader import load_model

    from engine.model.notes import print_notes

    return load_model(ModelSpec(source=a.model, device=a.device, dtype=a.dtype), print_notes)  # the memory verdict


def _contexts(a) -> list[int]:
    raw = str(a.contexts)
    try:
        return [int(c) for c in raw.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--contexts {raw!r}: a comma list of prompt lengths, e.g. 256,1024") from None


def _modes(a) -> list[str]:
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        base, _, kv = m.partition(":")
        if m not in HF_MODES and (base not in ENGINE_MODES or (kv and kv not in K_DTYPES) or
                                  (kv and base != "paged")):
            raise ValueError(f"bench mode {m!r} is not one of {', '.join(list(HF_MODES) + list(ENGINE_MODES))}"
                             f" (or paged:KIND, KIND one of {', '.join(K_DTYPES[1:])})")
    return modes


def check_flags(a) -> None:
    """The flags that need no model, refused (ValueError, one line) before it loads: before, ``--new-tokens 0``
    failed only after loading, and ``--contexts ''`` or ``--repeats 0`` wrote a file of empty rows, exit 0."""
    contexts, modes = _contexts(a), _modes(a)
    for flag, low in (("new_tokens", 1), ("repeats", 1), ("long", 0), ("reuse_history", 0), ("prefix_cache", 0)):
        value = getattr(a, flag, low)
        if value < low:
            must = "it must be at least 1" if low else "it cannot be negative"
            raise ValueError(f"--{flag.replace('_', '-')} {value}: {must}")
    if any(c < 1 for c in contexts):
        raise ValueError(f"--contexts {a.contexts!r}: every prompt length must be at least 1")
    if (contexts or getattr(a, "long", 0)) and not modes:
        raise ValueError(f"--modes {a.modes!r} names no mode: e.g. hf-dynamic,paged")
    levels = _levels(a)
    if any(n < 1 or n > 64 for n in levels):
        raise ValueError(f"--concurrency {a.concurrency}: each level must be 1..64 sessions")
    if levels and not contexts:
        raise ValueError("--concurrency needs prompt lengths in --contexts (each level runs at each of them)")
    others = ("long", "reuse_history", "prefix_cache", "scenario", "server")
    if not contexts and not any(getattr(a, f, None) for f in others):
        raise ValueError(f"--contexts {a.contexts!r} gives no prompt length and no other measurement is asked for "
                         "(--long, --reuse-history, --prefix-cache, --scenario, --server): e.g. --contexts 256,1024")
    CacheConfig(page_size=a.page_size)  # its own one-line ValueError


def _check_args(a, lm) -> tuple[list[int], list[str]]:
    """Contexts and modes against the model's context, refused (ValueError, one line) before any work;
    ``check_flags(a)`` passed before the model loaded."""
    contexts, modes = _contexts(a), _modes(a)
    ctx_limit = lm.info.context_length
    for c in contexts:
        if c + a.new_tokens > ctx_limit:
            raise ValueError(f"context {c} + {a.new_tokens} new tokens does not fit the model's {ctx_limit}")
    if a.long and 16 + a.long > ctx_limit:
        raise ValueError(f"--long {a.long} does not fit the model's context {ctx_limit}")
    if getattr(a, "prefix_cache", 0) and not 1 <= a.shared_prompt <= ctx_limit - 24 - 16:
        raise ValueError(f"--shared-prompt {a.shared_prompt}: with a 24-token question and 16 new tokens it must be "
                         f"1..{ctx_limit - 40} for the model's context of {ctx_limit}")
    return contexts, modes


def _levels(a) -> list[int]:
    raw = str(getattr(a, "concurrency", "") or "")
    try:
        return [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {raw!r}: a comma list of session counts, e.g. 1,4") from None


def _concurrency_rows(lm, a, contexts: list[int], log) -> list[dict[str, Any]]:
    """Rows with ``concurrency`` N: N sessions at each context decoding together (engine.tools.bench_scenarios)."""
    from engine.tools import bench_scenarios as sc

    rows = []
    for ctx in contexts:
        base = None
        for n in _levels(a):
            r = sc.concurrency(lm, n, ctx, a.new_tokens, a.page_size)
            base = base or r["throughput_tokens_per_s"]
            r.update(engine="kvscope", mode="paged", page_size=a.page_size,
                     throughput_over_one=round(r["throughput_tokens_per_s"] / base, 3) if base else None)
            log(f"  kvscope  paged x{n:<3d}  ctx {ctx:5d}  throughput {r['throughput_tokens_per_s']:8.2f} tok/s "
                f"(decode {r['decode_throughput_tokens_per_s']:8.2f}, ×{r['throughput_over_one']} one session's)")
            rows.append(r)
    return rows


def _measure(lm, a, mode: str, prompt: list[int], n: int) -> dict[str, Any]:
    if mode in HF_MODES:
        return run_hf(lm, prompt, n, use_cache=(mode == "hf-dynamic"))
    spec = mode.endswith(bench_spec.SUFFIX)
    base, _, kv = mode.removesuffix(bench_spec.SUFFIX).partition(":")
    kv = kv or "auto"
    cache = CacheConfig(mode=base, page_size=a.page_size, k_dtype=kv, v_dtype=value_dtype(kv))
    return run_engine(lm, prompt, n, cache, a if spec else None)


def _rows(a, ctx: int, n: int, results: dict[str, list[dict]], log, kind: str = "") -> list[dict[str, Any]]:
    """One row per mode: medians over the repeats."""
    rows = []
    for mode, rs in results.items():
        spec = mode.endswith(bench_spec.SUFFIX)
        base, _, kv = mode.removesuffix(bench_spec.SUFFIX).partition(":")
        row = {
            "engine": "hf" if mode in HF_MODES else "kvscope",
            "mode": HF_MODES.get(mode, base),
            "context": ctx,
            "new_tokens": n,
            "ttft_ms": round(statistics.median(r["ttft_ms"] for r in rs), 2),
            "decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in rs), 3),
            "kv_bytes": rs[-1]["kv_bytes"],
        }
        if mode not in HF_MODES:
            row["speculative"] = None  # the plain run a speculative row is paired with
            if spec:
                row.update(bench_spec.fields_median(rs))
        if base == "paged":
            row["page_size"] = a.page_size
            row["compiled_tokens"] = rs[-1].get("compiled_tokens", 0)  # decode tokens the compiled step gave
        if kv:
            row["kv_dtype"] = kv
        if kind:
            row["kind"] = kind
        rows.append(row)
        log(f"  {row['engine']:8s} {HF_MODES.get(mode, mode):10s} ctx {ctx:5d}  ttft {row['ttft_ms']:9.1f} ms  "
            f"decode {row['decode_tokens_per_s']:8.2f} tok/s  kv {row['kv_bytes'] / 2**20:7.2f} MiB"
            + (f"  accepted {row['accepted_draft_tokens']}/{row['draft_tokens']}, {row['tokens_per_forward']} tok/fwd"
               if spec else ""))
    return rows


def _fast_step(lm, a, log) -> dict[str, Any]:
    """The decode step the engine rows use: compiled (``engine.model.fast_step``, waited for here, so no timed token
    is eager for want of it) unless ``--eager`` or ``KVSCOPE_FAST_STEP=off``."""
    from engine.model.fast_step import env_mode

    fast = lm.fast
    fast.set_mode("off" if getattr(a, "eager", False) or env_mode() == "off" else "on")
    if fast.state == "idle":
        log("  compiling the decode step ...")
        fast.start()
        fast.wait()
    log(f"  decode step: {fast.describe()}" + (f" (compiled in {fast.compile_s:.1f} s)" if fast.compile_s else ""))
    out = {"state": fast.state, "reason": fast.reason, "compile_s": round(fast.compile_s, 2)}
    batch = fast.batch
    if batch is not None and any(n > 1 for n in _levels(a)):  # several chats decode together: their compiled step too
        if batch.state == "idle":
            log("  compiling the batched decode step ...")
        fast.start_batch()
        batch.wait()
        log(f"  batched step: {batch.describe()}" + (f" (compiled in {batch.compile_s:.1f} s)" if batch.compile_s else ""))
        out["batch"] = {"state": batch.state, "reason": batch.reason, "compile_s": round(batch.compile_s, 2)}
    return out


def _turn_reuse(lm, a, log) -> dict[str, Any]:
    t = run_turn_reuse(lm, a.reuse_history, 24, CacheConfig(mode="paged", page_size=a.page_size))
    log(f"  turn at history {a.reuse_history}: reuse {t['reuse']:.1f} ms vs full {t['full']:.1f} ms")
    return {"history": a.reuse_history, "new_tokens": 24, "ttft_reuse_ms": round(t["reuse"], 2),
            "ttft_full_ms": round(t["full"], 2), "reused_tokens": t["reused_tokens"],
            "ratio": round(t["reuse"] / t["full"], 4) if t["full"] else None}


def run_bench(a) -> int:
    check_flags(a)
    lm = _load(a)
    contexts, modes = _check_args(a, lm)
    bench_spec.setup(a, lm)
    modes = bench_spec.with_spec(a, modes)
    a.contexts_list = contexts
    if getattr(a, "scenario", "") in ("reopen", "branch"):
        contexts = []  # the reopened chats' lengths (engine.tools.bench_reopen), not prompts for every mode
    torch.set_grad_enabled(False)
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731
    name = a.shape or a.model
    log(f"bench {name}: {lm.info.num_layers} layers, kv heads {lm.info.num_kv_heads}, threads {torch.get_num_threads()}")
    step = _fast_step(lm, a, log)
    warm = _prompt(lm.info.vocab_size, 16)  # warm up every path once (allocator, oneDNN kernels)
    run_hf(lm, warm, 2, True)
    run_engine(lm, warm, 2, CacheConfig(mode="paged", page_size=a.page_size))
    rows: list[dict[str, Any]] = []
    for ctx in contexts:
        lm.runner.spec_verdicts.clear()  # each prompt finds out afresh whether speculation pays (its repeats share it)
        prompt = _prompt(lm.info.vocab_size, ctx)
        results: dict[str, list[dict]] = {m: [] for m in modes}
        if lm.device.type == "cuda":  # kernels for this prompt length load lazily: not in the first timed run
            for m in modes:
                _measure(lm, a, m, prompt, 2)
        for _ in range(a.repeats):  # round robin, so drifting load hits every mode alike
            for m in modes:
                results[m].append(_measure(lm, a, m, prompt, a.new_tokens))
        rows += _rows(a, ctx, a.new_tokens, results, log)
    if _levels(a):
        rows += _concurrency_rows(lm, a, contexts, log)
    if a.long:
        prompt = _prompt(lm.info.vocab_size, 16, seed=3)
        rows += _rows(a, 16, a.long, {m: [_measure(lm, a, m, prompt, a.long)] for m in modes}, log, kind="long")
    if getattr(a, "scenario", "") == "reopen":
        from engine.tools import bench_reopen

        rows += bench_reopen.rows(lm, a, log)
    if getattr(a, "scenario", "") == "branch":
        from engine.tools import bench_branch

        rows += bench_branch.rows(lm, a, log)
    if getattr(a, "scenario", "") == "copy":
        a.bench_modes = modes
        rows += bench_spec.copy_rows(lm, a, _measure, _rows, log)
    extra: dict[str, Any] = {"turn_reuse": _turn_reuse(lm, a, log)} if a.reuse_history else {}
    extra.update(_scenarios(lm, a, log))
    device = torch.cuda.get_device_name(0) if lm.device.type == "cuda" else lm.device.type
    out = {"model": name, "threads": torch.get_num_threads(), "torch": torch.__version__, "device": device,
           "dtype": str(lm.kv_dtype).removeprefix("torch."), "rows": rows, "step": step, **extra}
    write_json(a.json_file, out)  # checked before the run (engine.tools.arguments.check_output_path)
    _print_ratios(rows, log)
    return 0


def _scenarios(lm, a, log) -> dict[str, Any]:
    """``--prefix-cache N``, ``--server`` and ``--scenario mixed`` (engine.tools.bench_scenarios)."""
    from engine.tools import bench_scenarios as sc

    out: dict[str, Any] = {}
    if getattr(a, "prefix_cache", 0):
        p = sc.prefix_cache(lm, a.prefix_cache, a.shared_prompt, min(a.new_tokens, 16), a.page_size)
        log(f"  prefix cache, {p['requests']} requests sharing {p['shared_prompt']} tokens: TTFT {p['ttft_ms']} ms "
            f"(rest / first ×{p['ttft_rest_over_first']}), pages {p['pages_all_requests']} vs one request's "
            f"{p['pages_one_request']} (×{p['pages_ratio']})")
        out["prefix_cache"] = p
    if getattr(a, "server", False):
        if lm.tokenizer is None:
            raise ValueError("--server needs a model with a tokenizer (--model DIR or demo), not --shape")
        o = sc.server_overhead(lm, "Once upon a time, there was a little girl", a.new_tokens)
        log(f"  server: {o['api_tokens_per_s']} tok/s through the API (whole completions) vs {o['direct_tokens_per_s']} direct "
            f"(×{o['ratio']})")
        out["server"] = o
    if getattr(a, "scenario", "") == "mixed":
        ctx = min(a.contexts_list[0] if getattr(a, "contexts_list", None) else 256, lm.info.context_length // 2)
        m = sc.mixed(lm, chat_tokens=64, api_context=ctx, page_size=a.page_size)
        log(f"  mixed: a chat message beside {m['streams_decoding']} decoding API streams: TTFT {m['busy_ttft_ms']} ms "
            f"vs {m['idle_ttft_ms']} ms idle (×{m['busy_over_idle']})")
        out["mixed"] = m
    return out


def _print_ratios(rows: list[dict], log) -> None:
    by = {(r["context"], r["mode"] + (":" + r["kv_dtype"] if "kv_dtype" in r else "")
           + (bench_spec.SUFFIX if r.get("speculative") else ""), r.get("kind", "")): r
          for r in rows if "concurrency" not in r and "mode" in r}
    for (ctx, mode, kind), r in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        hf = by.get((ctx, "dynamic", kind))
        if r["engine"] == "kvscope" and hf and hf["decode_tokens_per_s"]:
            log(f"  ratio vs HF dynamic  ctx {ctx:5d} {kind:4s} {mode:10s} decode ×{r['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.3f}"
                f"  ttft ×{r['ttft_ms'] / hf['ttft_ms']:.3f}")
