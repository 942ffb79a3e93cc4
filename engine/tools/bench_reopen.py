"""``bench --scenario reopen``: a long chat written by this process with the KV disk tier on (``engine.kv.tier.disk``),
then reopened by a NEW process (a subprocess, as after a restart) that takes its pages from disk, against one
that prefills it: time to first token of each. Also decode speed with the disk writer on vs off in this process.

Rows: ``{"scenario": "reopen", "context": N, "restore": "disk" | "prefill", "ttft_ms", "disk_restored_tokens",
"first_token"}`` and ``{"scenario": "reopen", "writer": "on" | "off", "decode_tokens_per_s"}``. The child runs as
``python -m engine.tools.bench_reopen JSON``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import torch

from engine.config import CacheConfig, SamplingConfig

SEED = 23
ROW = {"engine": "kvscope", "mode": "paged", "kind": "reopen"}  # as bench's other rows name them


def _chat_ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _run(lm, ids: list[int], new_tokens: int, page_size: int):
    """One greedy reply to ``ids``: its last ``TurnStats`` and tokens."""
    from engine.core.scheduler import drive
    from engine.core.session import ChatSession

    s = ChatSession(lm, CacheConfig(mode="paged", page_size=page_size))
    try:
        s.start_ids(ids, SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True))
        for r in drive(s):
            pass
        return r.stats, s.generated_ids
    finally:
        s.close()


def _child(args: list[str], env: dict) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "engine.tools.bench_reopen", json.dumps(args)], env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"reopen child failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rows(lm, a, log) -> list[dict[str, Any]]:
    """The reopen rows at each of ``a.contexts`` (capped to the model's context), then writer on vs off."""
    from engine.kv.tier import disk

    own = getattr(a, "kv_disk", "off") in ("", "off", None)
    folder = tempfile.mkdtemp(prefix="kvscope-reopen-") if own else a.kv_disk
    load = {"shape": a.shape, "model": a.model, "device": a.device, "dtype": a.dtype}
    env = {**os.environ, "KVSCOPE_FAST_STEP": "off"}  # no background compile in the children
    out: list[dict[str, Any]] = []
    try:
        for ctx in a.contexts_list or [2048]:
            ctx = min(ctx, lm.info.context_length - 2 * a.new_tokens)
            ids = _chat_ids(lm.info.vocab_size, ctx, SEED + ctx)
            disk.configure(lm, folder)
            _run(lm, ids, 1, a.page_size)
            lm.kv_arenas.disk.flush()  # the chat is on disk, as after a quit
            disk.configure(lm, None)
            for restore in ("disk", "prefill"):
                r = _child({**load, "ids": ids, "page_size": a.page_size,
                            "folder": folder if restore == "disk" else None}, env)
                out.append({"scenario": "reopen", **ROW, "context": ctx, "restore": restore, **r})
            d, p = out[-2], out[-1]
            log(f"  reopen {ctx} tokens in a new process: TTFT {d['ttft_ms']} ms from disk "
                f"({d['disk_restored_tokens']} tokens restored) vs {p['ttft_ms']} ms prefilled "
                f"(×{d['ttft_ms'] / p['ttft_ms']:.3f}); same first token: {d['first_token'] == p['first_token']}")
        out += _writer_rows(lm, a, folder, log)
    finally:
        disk.configure(lm, None)
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def _writer_rows(lm, a, folder: str, log) -> list[dict[str, Any]]:
    """Decode tokens/s of a new chat each time (its pages written while it decodes) with the tier on vs off,
    alternating ``a.repeats`` times (on first, then off first: neither gains from going second); medians."""
    from engine.kv.tier import disk

    ctx = min(a.contexts_list[0] if a.contexts_list else 256, lm.info.context_length - 2 * a.new_tokens)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(max(1, a.repeats)):
        for writer in ("on", "off")[::1 if i % 2 == 0 else -1]:
            disk.configure(lm, folder if writer == "on" else None)
            st, _ = _run(lm, _chat_ids(lm.info.vocab_size, ctx, 1000 + 2 * i + (writer == "on")), a.new_tokens,
                         a.page_size)
            rates[writer].append(st.decode_tokens_per_s)
            lm.kv_arenas.drop_idle()  # no page of this chat stays in memory for the next
    disk.configure(lm, None)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    log(f"  reopen: decode {on:.1f} tok/s with the disk writer on vs {off:.1f} off (×{on / off:.3f})")
    return [{"scenario": "reopen", **ROW, "writer": w, "context": ctx, "new_tokens": a.new_tokens,
             "decode_tokens_per_s": round(statistics.median(rates[w]), 3)} for w in ("on", "off")]


def _load(spec: dict[str, Any]):
    """The model the parent benchmarks, loaded again (``--shape``: the same seeded random weights)."""
    if spec["shape"]:
        from engine.model.shapes import build_shape

        dtype = getattr(torch, spec["dtype"]) if spec["dtype"] != "auto" else torch.float32
        return build_shape(spec["shape"], device=spec["device"], dtype=dtype)
    from engine.config import ModelSpec
    from engine.model.loader import load_model

    return load_model(ModelSpec(source=spec["model"], device=spec["device"], dtype=spec["dtype"]))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """In the new process: load the model, warm up, then the chat's first token (from disk, or prefilled)."""
    from engine.kv.tier import disk

    lm = _load(spec)
    torch.set_grad_enabled(False)
    _run(lm, _chat_ids(lm.info.vocab_size, 64, 7), 2, spec["page_size"])  # kernels and allocator, no disk
    lm.kv_arenas.drop_idle()
    if spec["folder"]:
        disk.configure(lm, spec["folder"])
    st, tokens = _run(lm, spec["ids"], 1, spec["page_size"])
    return {"ttft_ms": round(st.ttft_ms, 2), "disk_restored_tokens": st.disk_restored_tokens,
            "recomputed_tokens": st.recomputed_tokens, "first_token": tokens[0]}


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
