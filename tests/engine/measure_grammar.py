"""llguidance against xgrammar on the fifty schemas (``json_schemas``) with Qwen2.5's vocabulary (151,665 tokens):
the time to compile each schema, and the time to compute the next token's mask at each token of a valid instance
(tokenized as the tokenizer reads it; the first token's apart), then consuming that token. Both single-threaded,
on the same tokens; medians and 90th percentiles.

    python tests/engine/measure_grammar.py [--json out.json]

xgrammar is not a dependency of the project: install it to run this (``pip install xgrammar``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_schemas import SCHEMAS, instance  # noqa: E402
from tool_models import QWEN_VOCAB, qwen_tokenizer  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def llguidance_run(tok, schemas, docs):
    import llguidance
    from llguidance.hf import from_tokenizer

    t0 = time.perf_counter()
    lt = from_tokenizer(tok, n_vocab=QWEN_VOCAB, eos_token=tok.eos_token_id)
    setup = time.perf_counter() - t0
    compile_s, mask_s, first_s = [], [], []
    for s, ids in zip(schemas, docs):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s), defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        for t in ids:
            t0 = time.perf_counter()
            bits = m.compute_bitmask()
            (mask_s if t is not ids[0] else first_s).append(time.perf_counter() - t0)
            assert np.frombuffer(bits, dtype=np.uint32)[t // 32] >> (t % 32) & 1, "llguidance refused a valid token"
            assert m.consume_token(t)
        assert m.is_accepting()
    return setup, compile_s, first_s, mask_s


def xgrammar_run(tok, schemas, docs):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=QWEN_VOCAB)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    compile_s, mask_s, first_s = [], [], []
    bitmask = xgr.allocate_token_bitmask(1, QWEN_VOCAB)
    for s, ids in zip(schemas, docs):
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(",", ":"))
        m = xgr.GrammarMatcher(cg)
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            (mask_s if t is not ids[0] else first_s).append(time.perf_counter() - t0)
            assert int(bitmask[0, t // 32]) >> (t % 32) & 1, "xgrammar refused a valid token"
            assert m.accept_token(t)
        assert m.accept_token(tok.eos_token_id), "xgrammar: the instance is not complete"
    return setup, compile_s, first_s, mask_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args()
    tok = qwen_tokenizer(Path(tempfile.mkdtemp()))
    docs = [tok.encode(json.dumps(instance(s), separators=(",", ":"))) for s in SCHEMAS]
    out = {}
    for name, run in (("llguidance", llguidance_run), ("xgrammar", xgrammar_run)):
        setup, comp, first, mask = run(tok, SCHEMAS, docs)
        out[name] = {"tokenizer_setup_s": setup, "compile_ms_median": 1e3 * statistics.median(comp),
                     "compile_ms_p90": 1e3 * pct(comp, 0.9), "first_mask_us_median": 1e6 * statistics.median(first),
                     "mask_us_median": 1e6 * statistics.median(mask),
                     "mask_us_p90": 1e6 * pct(mask, 0.9), "mask_us_mean": 1e6 * statistics.mean(mask),
                     "tokens": len(mask) + len(first)}
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in out[name].items()}, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
