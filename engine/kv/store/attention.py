"""Attention that also reports its probabilities (for H2O's accumulated-attention scores) or its inputs (for
Expected Attention's query statistics: ``kvscope_observer``), and RoPE
re-rotation of cached keys (for StreamingLLM's in-cache positions; ``Rerotator`` and ``rerotation_refusal``
live in ``engine.kv.store.rope`` and are re-exported here).

``kvscope_scores`` is registered with transformers' ``AttentionInterface`` (and ``sdpa_mask`` as its mask
builder, so prefix-reuse turns get a correct causal mask). It computes softmax explicitly, so it is only
selected while a policy needs scores; otherwise models run stock ``sdpa``.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.kv.quantized import tq_attend
from engine.kv.quantized.basis import KEY as BASIS_KEY
from engine.kv.store import paged_decode, prefill_attend
from engine.kv.store.rope import Rerotator, rerotation_refusal  # noqa: F401 - re-exported

SCORES_IMPL = "kvscope_scores"
DISPATCH_IMPL = "kvscope"  # what ``engine.model.runner`` selects once on an sdpa model: see ``dispatch_attention``
RAGGED_KEY = "kvscope_ragged"  # the attention kwargs entry with each sequence's K/V of a batched decode
PADDED_KEY = "kvscope_padded"  # the attention kwargs entry with a compiled batched step's keep mask [B, 1, 1, n]


class RaggedUnsupported(RuntimeError):
    """The model cannot run a batched decode over separate stores (its attention bypasses what the cache returns)."""
_registered = False


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)  # [B, H*rep, n, D]


def scores_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                     s_aux=None, **kwargs):
    """Eager attention, as the model's own eager path computes it (Gemma 2's logit ``softcap``, gpt-oss's
    learned attention sinks ``s_aux``); hands the probabilities to ``kwargs["kvscope_sink"](layer_idx, probs)``.

    query [1, Hq, q, D]; key/value [1, Hkv, L, D] / [1, Hkv, L, Dv] (what the cache returned).
    Returns ([1, q, Hq, Dv], None).
    """
    n_rep = query.shape[1] // key.shape[1]  # GQA groups (not every attention class names them)
    q_len, kv_len = query.shape[2], key.shape[2]
    k = _repeat_kv(key, n_rep)  # [1, Hq, L, D]
    v = _repeat_kv(value, n_rep)  # [1, Hq, L, Dv]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    w = torch.matmul(query.float(), k.float().transpose(2, 3)) * scale  # [1, Hq, q, L]
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        m = attention_mask[..., :kv_len]
        w = w.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else w + m.float()
    elif q_len > 1:  # causal, aligned bottom-right: query i sees keys <= L - q + i
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=w.device).tril(kv_len - q_len)
        w = w.masked_fill(~causal, float("-inf"))
    if s_aux is not None:  # a learned sink logit per head takes part in the softmax, then is dropped
        sinks = s_aux.float().reshape(1, -1, 1, 1).expand(1, w.shape[1], q_len, 1)  # [1, Hq, q, 1]
        probs = torch.softmax(torch.cat([w, sinks], dim=-1), dim=-1)[..., :-1]  # [1, Hq, q, L]
    else:
        probs = torch.softmax(w, dim=-1)  # [1, Hq, q, L]
    sink = kwargs.get("kvscope_sink")
    if sink is not None:
        sink(module.layer_idx, probs)
    observer = kwargs.get("kvscope_observer")
    if observer is not None:
        observer(query, key, value, scale)
    out = torch.matmul(probs.to(v.dtype), v)  # [1, Hq, q, D]
    return out.transpose(1, 2).contiguous(), None


UPCAST_MAX_Q = 16  # queries per sequence up to which a bf16/f16 CPU attention runs in float32 (see ``sdpa``)


def sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa, except that a bfloat16 / float16 attention of a few queries on a CPU runs in float32:
    torch's CPU flash kernel for one reduced-precision query is 4-8x slower than for float32 (SmolLM2 shape,
    2,048 cached tokens: 7.6 vs 1.6 ms a layer with the cast included; 512: 2.0 vs 0.4), so a bf16 model decoded
    slower than a float32 one. Prompts (more queries) keep the reduced-precision kernel, faster there. The output
    comes back in the model's dtype; the softmax was float32 either way."""
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16) and query.shape[2] <= UPCAST_MAX_Q:
        out = paged_decode.attend_tensors(query, key, value, attention_mask, kwargs)  # one bf16 query: in place
        if out is not None:
            return out, None  # [1, 1, Hq, Dv]
        mask = attention_mask
        if mask is not None and mask.is_floating_point():
            mask = mask.float()  # an additive mask in the model's dtype
        out, w = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
        return out.to(query.dtype), w  # [1, q, Hq, Dv]
    out = prefill_attend.attend(module, query, key, value, attention_mask, kwargs)  # a few float32 rows over many keys
    if out is None:
        out = _masked_gqa(module, query, key, value, attention_mask, kwargs)
    if out is not None:
        return out, None  # [B, q, Hq, Dv]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _masked_gqa(module, query, key, value, mask, kwargs) -> torch.Tensor | None:
    """Several queries with a mask over grouped K/V heads on a CPU: torch's SDPA reading each K/V head for its
    group of query heads (``enable_gqa``), where transformers' sdpa copies K/V out to every query head first
    (``repeat_kv``: it keeps GQA for mask-free calls, as CUDA's fast kernels need). Bit-identical output (float32
    and bfloat16, bool and additive masks); a prefix-reuse prefill is always masked (its queries end a longer K/V),
    and there the copies cost: SmolLM2 shape, 80 new tokens over 4,680 keys, 25 -> 15 ms a layer, one thread.
    None where transformers' own path applies (one query, soft-capping, a position bias, sinks, other head widths)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (mask is None or groups <= 1 or query.device.type != "cpu" or query.shape[2] == 1
            or query.shape[1] != key.shape[1] * groups or key.shape[-1] != value.shape[-1]
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("output_attentions")):
        return None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"),
        enable_gqa=True)  # [B, Hq, q, Dv]
    return out.transpose(1, 2).contiguous()  # [B, q, Hq, Dv]


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of a batched forward whose sequences' tokens lie end to end: segment b of the queries attends to
    sequence b's own cached K/V (lengths differ, no padding), each with torch's SDPA as the model's own ``sdpa``
    path calls it — one new token sees everything its sequence caches; a prefill chunk is causal, aligned to
    the end of its K/V. query [1, Hq, N, D]; ``kwargs["kvscope_ragged"]``: (B triples of [1, Hkv, n_b, D] /
    [1, Hkv, n_b, Dv] / a ``Basis`` they were left rotated in or None, the B segment lengths); a decode token's tq
    pages left as codes go to the fused kernel. Returns ([1, N, Hq, Dv], None)."""
    parts, lens = kwargs.pop(RAGGED_KEY, (None, None))
    if parts is None or len(parts) != len(lens) or query.shape[0] != 1 or sum(lens) != query.shape[2]:
        raise RaggedUnsupported("batched forward: the attention did not get each sequence's K/V for its queries")
    outs = []
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5  # the query's own width (QJL keys widen)
    for q, (k, v, basis) in zip(query.split(lens, dim=2), parts):  # q [1, Hq, q_b, D]
        if basis is not None:  # tq pages left rotated (engine.kv.quantized.basis)
            q = basis.queries(q)
            if basis.fused is not None:
                o = tq_attend.attend(basis.fused, q, k, None, {"scaling": scaling, **kwargs})
                if o is not None:
                    outs.append(basis.outputs(o))  # [1, 1, Hq, Dv]
                    continue
                k, v = basis.fused.materialize()
        if k.shape[-1] != q.shape[-1] or q.shape[1] % k.shape[1]:
            raise RaggedUnsupported(f"batched forward: cached keys {tuple(k.shape)} do not match queries "
                                    f"{tuple(q.shape)} (the model transforms what it caches)")
        q_len, kv_len = q.shape[2], k.shape[2]
        mask = None
        if q_len > 1:  # causal, aligned bottom-right: query i sees keys <= kv_len - q_len + i
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)[None, None]
        o, _ = sdpa(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
        outs.append(o if basis is None else basis.outputs(o))  # [1, q_b, Hq, Dv]
    return torch.cat(outs, 1), None  # [1, N, Hq, Dv]


def padded_attention(module, query, key, value, keep, scaling=None, dropout=0.0, **kwargs):
    """Attention of the compiled batched decode step (``engine.model.fast_batch``): one new token per sequence over
    K/V padded to the longest sequence, ``keep`` [B, 1, 1, n] bool saying which keys are the sequence's own.
    Each K/V head's group of query heads becomes its queries (transformers' ``pack_gqa``, which it skips under a
    tracer), so GQA K/V are read once rather than repeated per query head (SmolLM2: 3 heads, not 9 copies). A
    bfloat16 / float16 attention runs in float32 on a CPU, as ``sdpa`` does. query [B, Hq, 1, D], key/value
    [B, Hk, n, D] / [B, Hk, n, Dv]. Returns ([B, 1, Hq, Dv], None)."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise RaggedUnsupported("the compiled batched step runs plain softmax attention (no soft-capping or sinks)")
    b, hq, _, d = query.shape
    hk, dt = key.shape[1], query.dtype
    q = query.reshape(b, hk, hq // hk, d)  # [B, Hk, rep, D]: query head h = kv head h // rep
    if query.device.type == "cpu" and dt in (torch.bfloat16, torch.float16):
        q, key, value = q.float(), key.float(), value.float()
    o = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=keep, scale=scaling)  # [B, Hk, rep, Dv]
    return o.to(dt).reshape(b, hq, 1, -1).transpose(1, 2).contiguous(), None  # [B, 1, Hq, Dv]


def dispatch_attention(module, query, key, value, attention_mask, **kwargs):
    """The one attention implementation the runner selects on an sdpa model: a batched decode (the cache handed
    each sequence's K/V) → ``ragged_attention``; the compiled batched step (a keep mask) → ``padded_attention``; a policy reading scores (the cache handed a sink) →
    ``scores_attention``; anything else → transformers' own sdpa, exactly as if "sdpa" were selected (HF
    ``generate`` on the same model, the compiled step). The model's config never changes around a call. K/V the
    cache left rotated (tq pages, ``engine.kv.quantized.basis``; never with a sink) come with the turn of the queries
    and the output."""
    if kwargs.get(RAGGED_KEY) is not None:
        return ragged_attention(module, query, key, value, None, **kwargs)
    step = kwargs.pop(paged_decode.STEP_KEY, None)
    keep = kwargs.pop(PADDED_KEY, None)
    if step is not None:  # a compiled decode step: its pages read in place where the operator applies
        out = paged_decode.attend(query, key, value, attention_mask, step, kwargs)
        if out is not None:
            return out, None  # [B, 1, Hq, Dv]
    if keep is not None:
        return padded_attention(module, query, key, value, keep, **kwargs)
    basis = kwargs.pop(BASIS_KEY, None)
    if basis is not None:  # the cache left rotated pages rotated: turn the queries, and the output back
        if kwargs.get("scaling") is None:
            kwargs["scaling"] = query.shape[-1] ** -0.5  # the query's own width (QJL keys widen it)
        turned = basis.queries(query)
        if basis.fused is not None:  # a decode step's pages left as codes: the fused kernel, else read them now
            out = tq_attend.attend(basis.fused, turned, key, attention_mask, kwargs)
            if out is not None:
                return basis.outputs(out), None  # [1, 1, Hq, Dv]
            key, value = basis.fused.materialize()
        out, _ = sdpa(module, turned, key, value, attention_mask, **kwargs)
        return basis.outputs(out), None  # [1, q, Hq, Dv]
    if kwargs.get("kvscope_sink") is not None:
        return scores_attention(module, query, key, value, attention_mask, **kwargs)
    observer = kwargs.pop("kvscope_observer", None)
    if observer is not None:  # a policy reading the queries (Expected Attention): the model's own SDPA beside it
        observer(query, key, value, kwargs.get("scaling"))
    return sdpa(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SCORES_IMPL, scores_attention)
    AttentionMaskInterface.register(SCORES_IMPL, sdpa_mask)
    # looked up at each call (tests replace the functions it routes to)
    AttentionInterface.register(DISPATCH_IMPL, lambda *a, **k: dispatch_attention(*a, **k))
    AttentionMaskInterface.register(DISPATCH_IMPL, sdpa_mask)
    _registered = True


def use_attention(model, impl: str) -> None:
    """Select ``impl`` ("sdpa", "eager", ``SCORES_IMPL`` or ``DISPATCH_IMPL``) on a model if not already selected."""
    if getattr(model.config, "_attn_implementation", None) == impl:
        return
    if impl in (SCORES_IMPL, DISPATCH_IMPL):
        register()
    model.set_attn_implementation(impl)
