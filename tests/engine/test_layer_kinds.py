"""Models whose layers cache different things: sliding windows (Gemma 2/3, Mistral SWA), recurrent / conv state
(LFM2), keys and values of different widths, and Falcon's ``num_kv_heads``. Tiny seeded random models of the
real transformers classes, compared with HF's own greedy ``generate``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.errors import EngineError, UnsupportedModelError
from engine.model.loaded import wrap_model
from engine.core.session import ChatSession

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
CONFIGS = {
    "gemma3_text": dict(SMALL, sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "gemma2": dict(SMALL, sliding_window=8),  # alternating sliding / full, softcapping: eager attention
    "mistral": dict(SMALL, sliding_window=8),  # every layer slides
    "lfm2": dict(SMALL, layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # attention and a mamba state side by side in every layer
    "falcon_h1": dict(SMALL, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16),
    # MLA: what is cached is a latent and a rotary key, of other widths than the attention heads
    "deepseek_v3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
                        first_k_dense_replace=1, max_position_embeddings=512),
}
N = 48
MODES = [CacheConfig(mode="off"), CacheConfig(mode="contiguous"), CacheConfig(mode="paged", page_size=3),
         CacheConfig(mode="paged", page_size=16)]


def tiny(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**CONFIGS.get(model_type, {}), **overrides})
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    except ValueError:  # no sdpa for this class (softcapping, sinks)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    return model, wrap_model(model, None, ModelSpec(source="test"), "cpu", "CPU", name=model_type, path=None,
                             is_demo=True)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def zoo(request):
    model, lm = tiny(request.param)
    return request.param, model, lm


def hf_greedy(model, ids, n):
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def run(s: ChatSession, ids, n, switches=None):
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    step, snaps = 0, []
    while True:
        if switches and step in switches:
            s.apply(switches[step])
        r = s.step()
        snaps.append(r.snapshot)
        step += 1
        if r.done:
            return list(s.generated_ids), snaps


IDS = list(range(5, 25))


@pytest.mark.parametrize("cache", MODES, ids=lambda c: f"{c.mode}{c.page_size if c.mode == 'paged' else ''}")
def test_exact_in_every_mode(zoo, cache):
    name, model, lm = zoo
    ref = hf_greedy(model, IDS, N)
    s = ChatSession(lm, cache)
    got, snaps = run(s, IDS, N)
    assert got == ref
    if cache.mode != "off":
        kinds, windows = lm.info.layer_kinds, lm.info.windows
        held = snaps[-1].tokens_per_layer
        for layer, (kind, w) in enumerate(zip(kinds, windows)):
            if kind.startswith("sliding"):  # only its window (plus the rest of its first page), never the reply
                page = cache.page_size if cache.mode == "paged" else 16
                assert w - 1 <= held[layer] <= w - 1 + page - 1, (layer, held[layer])
            elif kind.startswith("full"):
                assert held[layer] == len(IDS) + N - 1
            else:
                assert held[layer] == 0 and snaps[-1].bytes_per_layer[layer] > 0  # its state, counted
    s.close()


def test_sliding_pages_go_back_to_the_pool(zoo):
    name, model, lm = zoo
    if "sliding" not in lm.info.layer_kinds:
        pytest.skip("no sliding layers")
    window = next(w for k, w in zip(lm.info.layer_kinds, lm.info.windows) if k == "sliding")
    per_window = -(-(window - 1) // 4) + 1
    for checkpoints in (0, 8):  # the prompt's checkpoint keeps the pages of its own window, no more
        s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, checkpoints=checkpoints))
        run(s, IDS, 80)
        win = s.store.windows[window]
        assert len(win.inner.table.pages) <= per_window
        kept = s.store.checkpoint_bytes()[1] // win.arena.page_bytes // len(s.store.windows)
        assert win.arena.pool.num_used == len(win.inner.table.pages) + kept
        assert (kept == 0) if checkpoints == 0 else (0 < kept <= per_window)
        s.close()
        assert win.arena.pool.num_used == 0


def test_two_turns_with_prefix_reuse_equal_re_prefilling(zoo):
    name, model, lm = zoo
    prompt2 = [7, 9, 11, 13]
    outs = []
    for reuse in (True, False):
        s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, prefix_reuse=reuse))
        first, _ = run(s, IDS, 30)
        second, _ = run(s, IDS + first[:-1] + prompt2, 30)  # the next turn extends everything fed so far
        outs.append((first, second, s.last_stats.reused_tokens))
        s.close()
    (f1, s1, reused), (f2, s2, none) = outs
    assert f1 == f2 and s1 == s2 and none == 0
    assert reused == len(IDS) + 29  # the whole first turn is kept, windows and states included


def test_regenerate_reuses_what_the_windows_and_states_allow(zoo):
    name, model, lm = zoo
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    first, _ = run(s, IDS, 30)
    again, _ = run(s, IDS, 30)  # regenerate: the prompt is a prefix of the cache
    assert again == first
    st = s.last_stats
    if "state" in lm.info.layer_kinds or "sliding" in lm.info.layer_kinds:
        # a recurrent state cannot be cut back, and the windows moved past the prompt's end: the checkpoint
        # taken before the prompt's last token is where the regenerate goes back to
        assert st.reused_tokens == len(IDS) - 1
    s.close()
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, checkpoints=0))
    run(s, IDS, 30)
    again, _ = run(s, IDS, 30)
    assert again == first
    if "state" in lm.info.layer_kinds or "sliding" in lm.info.layer_kinds:
        # without checkpoints: the prefix cache's last whole page before the prompt's last token (its pages, the
        # window's pages, the states its prefill left on the model's shelf there)
        assert s.last_stats.reused_tokens == (len(IDS) - 1) // 4 * 4
    s.close()


def test_mode_page_size_and_precision_switches_mid_reply(zoo):
    name, model, lm = zoo
    ref = hf_greedy(model, IDS, N)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    got, _ = run(s, IDS, N, {8: CacheConfig(mode="contiguous"), 20: CacheConfig(mode="paged", page_size=8),
                             30: CacheConfig(mode="paged", page_size=3)})
    assert got == ref
    # quantized pages read by the fused kernel or rotated where the attention takes the cache's K/V as they are;
    # on MLA (its latent expanded after the cache) read back as tensors
    q = {k: CacheConfig(mode="paged", page_size=16, k_dtype=d, v_dtype=d) for k, d in ((4, "int8"), (8, "int4"),
                                                                                    (12, "tq3"))}
    got, snaps = run(s, IDS + got[:-1], 16, q)
    assert len(got) == 16 and snaps[-1].k_dtype == "tq3"
    s.close()


def test_swap_and_fork_keep_every_kind(zoo):
    name, model, lm = zoo
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    first, _ = run(s, IDS, 20)
    f = s.fork()
    assert s.swap_out() > 0 and s.offloaded
    follow = IDS + first[:-1] + [3, 4]
    a, _ = run(s, follow, 20)  # swapped back in first
    b, _ = run(f, follow, 20)
    ref = hf_greedy(model, follow, 20)
    assert a == b == ref
    s.close()
    f.close()


def test_policies_follow_these_layers_or_are_refused_before_anything_changes(zoo):
    # evicting runs on the full-attention layers; windows and states keep what they keep. StreamingLLM and the
    # rolling overflow also move positions: the windows' keys move with them, MLA re-rotates its rotary key
    # (tests/engine/test_layer_policies.py checks what each does); only a model whose every layer slides refuses
    name, model, lm = zoo
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    run(s, IDS, 10)
    before = s.cache_config
    full = [i for i, k in enumerate(lm.info.layer_kinds) if k.startswith("full")]
    for cfg in (CacheConfig(policy="streaming", policy_params={"sinks": 2, "window": 16}),
                CacheConfig(overflow="rolling"), CacheConfig(policy="h2o", policy_params={"budget": 24, "recent": 8})):
        if full:
            s.apply(cfg)
            got, snaps = run(s, IDS + [1, 2, 3], 40)
            assert len(got) == 40 and max(snaps[-1].tokens_per_layer[full]) <= (18 if cfg.policy == "streaming" else
                                                                                 24 if cfg.policy == "h2o" else 90)
            s.apply(before)
        else:
            with pytest.raises(ValueError, match="every layer of this model slides"):
                s.apply(cfg)
            assert s.cache_config == before
    s.close()


def test_model_facts_come_from_what_the_model_caches():
    # Falcon-7B style: multi-query attention, its config's num_kv_heads says 8 (the attention heads)
    _, lm = tiny("falcon", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                 multi_query=True, new_decoder_architecture=False, max_position_embeddings=512)
    info = lm.info
    assert (info.k_heads, info.v_heads) == (1, 1)  # what the model caches: one KV head, not 8
    assert info.kv_bytes_per_token == 2 * 2 * 1 * 8 * 4  # layers × (K + V) × heads × head dim × float32
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    run(s, IDS, 8)
    assert s.snapshot().kv_bytes == 2 * 2 * 1 * 8 * 4 * 4 * 7  # 27 tokens in 7 pages of 4
    _, lm = tiny("gemma3_text")
    assert lm.info.layer_summary == "4 layers: 1 full · 3 sliding (window 8)"
    per = lm.info.layer_bytes_per_token
    assert lm.info.kv_bytes_at(1000) == per * (1000 + 3 * 7)  # windows bound the sliding layers (8 - the query)


def test_models_that_cannot_run_say_why_in_one_line():
    from engine.model.arch import LayerFacts, refusal

    assert "different shapes" in refusal((LayerFacts("full", 0, 2, 16, 2, 16), LayerFacts("full", 0, 4, 16, 4, 16)))
    assert refusal((LayerFacts("full", 0, 2, 16, 2, 16), LayerFacts("none"))) is None  # MLP-only layers
    assert "not supported" in refusal((LayerFacts("DynamicIndexedLayer"),))
    _, lm = tiny("gemma3_text")
    bad = dataclasses.replace(lm, info=dataclasses.replace(lm.info, unsupported="some reason"), arenas=None)
    with pytest.raises(UnsupportedModelError, match="gemma3_text: some reason"):
        ChatSession(bad)
    assert issubclass(UnsupportedModelError, EngineError)


def test_re_rotating_policies_are_refused_for_keys_without_rope():
    _, lm = tiny("gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1,
                 eos_token_id=2)
    for cfg in (CacheConfig(policy="streaming", policy_params={"sinks": 2, "window": 64}),
                CacheConfig(overflow="truncate_middle")):
        with pytest.raises(ValueError, match="absolute position embeddings"):
            ChatSession(lm, cfg)
    s = ChatSession(lm, CacheConfig(policy="h2o", policy_params={"budget": 24, "recent": 8}))  # keeps positions
    got, snaps = run(s, IDS, 30)
    assert len(got) == 30 and snaps[-1].tokens_per_layer.max() <= 24
    s.close()
