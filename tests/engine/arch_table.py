"""Markdown for ``arch_report.json`` (made by ``arch_report.py``): counts, findings, one row per type, skips."""

from __future__ import annotations

from collections import Counter

# Hand-written: what the rows mean (checked against the 5.24 sources, the engine and the JSON). Update them when
# a regenerated report changes a verdict.
NOTES = """\
## Findings

**Failing (engine bugs; strict xfails in `test_arch_coverage.py`, repro: `arch_report.py TYPE`, or
`arch_report.py --save DIR TYPE` then `python -m engine generate --model DIR/TYPE --prompt hi --offline
--device cpu`):**

1. **No attention at all** (mamba, mamba2, falcon_mamba, rwkv, xlstm): `wrap_model` (engine/model/loaded.py) reads
   `num_attention_heads` before asking the model what it caches, so loading raises a bare `AttributeError`
   (CLI: `error: internal AttributeError ...`, exit 1) instead of a one-line `UnsupportedModelError` (exit 2).
2. **Per-layer heads** (dots3_note_text, heterogeneous MLA): the same read raises transformers'
   `AmbiguousGlobalPerLayerAttributeError`; exit 1.
3. **Looped layers** (inkling2_loop_text: 2 model layers, 4 cache layers, one per loop pass): `StateLayers`
   (engine/kv/store/states.py:22) builds `DynamicCache(config)` (2 layers; the loop adds the others during a forward)
   and indexes layers 2 and 3: a bare `IndexError` from `ChatSession(...)`, not an `EngineError`.
4. **Learned prompt tokens in the cache** (cpmant: `prompt_length` tokens prepended, so the cache holds T + 4
   per layer): contiguous and paged end with `InternalError` (a size mismatch in storage.py / the model's
   attention). `off` equals HF's own `generate(use_cache=False)`, which differs from HF's cached `generate` from
   token 3: transformers itself is inconsistent there. A probe check "cached more tokens than fed" could refuse it.
5. **State outside the cache** (recurrent_gemma: `rg_lru.recurrent_states`, `temporal_block.conv1d_state` are
   module attributes): the probe calls the layer `state` with 0 bytes. One chat is exact in every mode and with
   prefix reuse, but two chats stepped in turn on the model (the session pool, a fork's parent going on) give
   other ids (from token 11 here), silently.

**Pricing:** every exact type's `kv_bytes_per_token` and `state_bytes` equal the bytes of the K, V and state
tensors HF's `DynamicCache` holds (MLA's 32-wide latent + 8-wide rope key included). Past the window,
`kv_bytes_at(t)` counts `window` tokens per sliding layer where HF (and the engine's own window store) keep
`window - 1`: one token per sliding layer too many (all 27 exact sliding types here).

**Refused, with the engine's reason:** DSA indexer caches (deepseek_v32, glm_moe_dsa, axk2, hy_v4,
qwen4_exp_text), other cache classes (deepseek_v4's CSA/HCA caches; minimax's own cache fails the probe), KV
sharing (gemma3n_text), K/V shapes that differ between layers (gemma4_text and gemma4_unified_text's wider full
layers, mimo_v2_flash's per-layer-type V width), and openai-gpt, which transformers gives no cache at all.

**The zoo:** 2-4 layers with one layer of each kind the architecture has, window 8 (the 12-token prompt
already slides), untied `lm_head` (tied to the embedding, a tiny random model mostly repeats its input token, as
a broken cache would: 40 types gave <= 3 distinct ids in 64), float32, one thread.
"""

STATUS = {"exact": "exact", "refused": "refused", "failing": "**failing**"}

# cache layer class -> short kind; the config's layer_types entry refines the state ones
_KIND = {
    "DynamicLayer": "full",
    "DynamicSlidingWindowLayer": "sliding",
    "DynamicIndexedLayer": "indexed",
    "LinearAttentionLayer": "state",
    "LinearAttentionAndFullAttentionLayer": "full+state",
    "LinearAttentionAndSlidingWindowAttentionLayer": "sliding+state",
    "DummyLayer": "none",
}
_STATE_NAMES = {"conv": "conv", "linear_attention": "linear/ssm"}


def layer_kind(row: dict, layer_type: str | None) -> str:
    kind = _KIND.get(row["class"], row["class"])
    if kind == "state":
        kind = _STATE_NAMES.get(layer_type or "", "state")
    if kind == "sliding" and layer_type == "chunked_attention":
        kind = "chunked"
    if "sliding_window" in row:
        kind += f"({row['sliding_window']})"
    return kind


def kinds(probe: dict) -> str:
    """HF's view: e.g. ``1 sliding(8) + 1 full``; where state lives outside the cache, that too."""
    lts = probe.get("layer_types") or []
    counts = Counter(layer_kind(row, lts[i] if i < len(lts) else None) for i, row in enumerate(probe["layers"]))
    parts = [f"{n} {k}" for k, n in counts.items()]
    if probe.get("own_cache"):
        parts.append(f"own {probe['cache_class']}")
    if probe.get("output_state"):
        parts.append("state in output")
    if probe.get("module_state"):
        parts.append("state in modules")
    return " + ".join(parts) or "no cache"


def shapes(probe: dict) -> str:
    """Cached widths per token and layer as HF holds them: K/V [heads x dim], MLA's latent + rope key, states."""
    seen: list[str] = []
    for row in probe["layers"]:
        if "k" in row:
            s = f"K{row['k']} V{row.get('v')}".replace(", ", "x")
            if row["k"][0] == 1 and row.get("v", [0])[0] == 1 and row["k"][1] != row["v"][1]:
                s = f"MLA latent {row['k'][1]} + rope key {row['v'][1]}"  # "keys"/"values" of the MLA cache
            if s not in seen:
                seen.append(s)
    extra = sum(r.get("state_bytes", 0) for r in probe["layers"]) + probe.get("extra_state_bytes", 0)
    out = ", ".join(seen)
    if extra:
        out += (", " if out else "") + f"state {extra} B"
    return out or "-"


def price(row: dict) -> str:
    """The engine's K+V bytes per token, and whether HF's cache holds that many."""
    b = row.get("bytes")
    if not b:
        return ""
    same = all(b[k][0] == b[k][1] for k in ("per_token", "state", "short"))
    return f"{b['per_token'][0]} {'= HF' if same else '≠ HF ' + str(b['per_token'][1])}"


def reason(row: dict) -> str:
    run = row.get("run", {})
    if row.get("verdict") == "refused":
        return run["load"]["reason"].replace("|", "\\|")
    if row.get("verdict") == "failing":
        return (row.get("failure") or str(row.get("build", "")))[:220].replace("|", "\\|")
    return f"{run.get('hf_distinct', '?')} distinct ids in {run.get('new_tokens', '?')}"


def render(doc: dict) -> str:
    rows = doc["types"]
    counts = Counter(r.get("verdict", "failing") for r in rows)
    lines = [
        "# Architecture coverage: every causal-LM type of transformers on kvscope's cache",
        "",
        f"Made by `tests/engine/arch_report.py` (transformers {doc['transformers']}, torch {doc['torch']}): each "
        "type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` as a tiny seeded random float32 model (`arch_zoo.py`), "
        f"{doc['new_tokens']} greedy tokens after a 12-token prompt. **exact**: the engine's ids equal HF's "
        "`generate` with the cache off, contiguous, paged (page 3 and 16), a second turn with prefix reuse equals "
        "re-prefilling it, and a chat stepped in turn with another on the same model keeps HF's ids; "
        "**refused**: loading raises an `EngineError` with the one-line reason shown; **failing**: anything else.",
        "",
        f"**{counts['exact']} exact · {counts['refused']} refused · {counts['failing']} failing · "
        f"{len(doc['skipped'])} skipped** (not plain text decoders, listed at the end).",
        "",
        NOTES,
        "## One row per type",
        "",
        "Layer kinds and widths as HF's `DynamicCache` holds them after a 3-token forward (one layer of each "
        "kind); bytes: the engine's `kv_bytes_per_token` and whether it equals HF's K+V bytes per token.",
        "",
        "| type | attention | layer kinds | cached per token and layer | KV B/token | status | reason / HF ids |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = row.get("probe")
        if p is None:
            lines.append(f"| {row['model_type']} | | build fails | | | {STATUS['failing']} | {reason(row)} |")
            continue
        lines.append(f"| {row['model_type']} | {p['attn_impl']} | {kinds(p)} | {shapes(p)} | {price(row)} | "
                     f"{STATUS[row['verdict']]} | {reason(row)} |")
    lines += ["", "## Skipped types (not plain text decoders)", ""]
    lines += [f"- `{t}`: {why}" for t, why in sorted(doc["skipped"].items())]
    return "\n".join(lines) + "\n"
