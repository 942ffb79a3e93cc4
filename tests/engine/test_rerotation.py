"""RoPE re-rotation of cached keys (engine.kv.store.rope), checked against the models' own forward.

For each rotary layout we build a tiny seeded random model, let transformers cache the keys of the same tokens at
positions p and at p + Δ, and require ``Rerotator(model)(layer, keys_at_p, Δ)`` to equal the keys cached at p + Δ
on every layer. Models whose keys cannot be moved must be refused with a reason.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from engine.kv.store.attention import Rerotator as RerotatorFromAttention
from engine.kv.store.rope import Rerotator, rerotation_refusal, rope_layout_or_reason

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "max_position_embeddings": 512}
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# model type -> (config overrides, what the layout must be: (rotary_dim, interleaved) per layer, None = no RoPE)
ROTARY = {
    "llama": ({}, [(16, False)] * 2),
    "qwen2": ({}, [(16, False)] * 2),
    "phi": ({"num_key_value_heads": 4}, [(8, False)] * 2),  # partial 0.5, sliced in the attention
    "gpt_neox": ({"num_key_value_heads": 4}, [(4, False)] * 2),  # partial 0.25, sliced in apply_rotary_pos_emb
    "stablelm": ({}, [(4, False)] * 2),  # partial 0.25, sliced in the attention
    "glm4": ({}, [(8, True)] * 2),  # partial 0.5, interleaved pairs inside apply_rotary_pos_emb
    "persimmon": ({"num_key_value_heads": 4}, [(8, False)] * 2),  # partial 0.5, sliced in the attention
    "cohere": ({}, [(16, True)] * 2),  # interleaved cos/sin from the rotary module
    "cohere2": ({"num_hidden_layers": 4}, [(16, True)] * 3 + [None]),  # RoPE on sliding layers only
    "gemma3_text": ({"num_hidden_layers": 4, "layer_types": GEMMA3_TYPES,  # one inv_freq per layer type
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1_000_000.0}}},
                    [(16, False)] * 4),
    "smollm3": ({"num_hidden_layers": 4}, [(16, False)] * 3 + [None]),  # no_rope_layers = [1, 1, 1, 0]
    # more families read by the same code (nothing per model type): a transformers update that changes how one
    # of them rotates shows up here
    "qwen3": ({}, [(16, False)] * 2),
    "mistral": ({}, [(16, False)] * 2),
    "gemma2": ({}, [(16, False)] * 2),
    "phi3": ({}, [(16, False)] * 2),
    "olmo2": ({}, [(16, False)] * 2),
    "starcoder2": ({}, [(16, False)] * 2),
    "nemotron": ({}, [(8, False)] * 2),  # partial 0.5
    "glm": ({}, [(8, True)] * 2),  # partial 0.5, interleaved
    "helium": ({}, [(16, True)] * 2),  # interleaved
    "ernie4_5": ({}, [(16, True)] * 2),  # interleaved
    "gpt_oss": ({}, [(16, False)] * 2),  # yarn (attention factor 1.35), cos/sin per pair instead of per channel
    "exaone4": ({"num_hidden_layers": 4}, [(16, False)] * 3 + [None]),  # RoPE on sliding layers only
}
SCALED = {  # llama with fixed-frequency scalings (yarn multiplies cos/sin by its attention factor)
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


def build(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**BASE, "num_hidden_layers": 2, **overrides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type, **kw)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.float().eval()


def cached_keys(model, ids: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
    """Keys the model caches for ``ids`` [B, n] at ``pos`` [B, n]; per layer [B, H, n, D] (post-RoPE)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
    return [layer.keys for layer in cache.layers]


def check_sequence(model, p0: int, delta: int, n: int = 7) -> None:
    """A whole sequence shifted by ``delta``: relative positions are unchanged, so every layer's keys before
    RoPE are the same, and re-rotating the keys at p must give the keys at p + delta."""
    ids = torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(p0, p0 + n)[None]  # [1, n]
    at_p, at_q = cached_keys(model, ids, pos), cached_keys(model, ids, pos + delta)
    rr = Rerotator(model)
    d = torch.full((n,), delta, dtype=torch.int64)
    for layer, (kp, kq) in enumerate(zip(at_p, at_q)):
        got = rr(layer, kp[0], d)  # [H, n, D]
        torch.testing.assert_close(got, kq[0], atol=1e-5, rtol=1e-5, msg=lambda m, layer=layer: f"layer {layer}: {m}")


def check_per_token(model, n: int = 6, atol: float = 1e-5, far: int = 511) -> None:
    """Each token moved by its own Δ (as eviction does). Every token runs alone (a batch of n one-token
    sequences), so its keys depend on its own position only, on every layer."""
    ids = torch.randint(3, 256, (n, 1), generator=torch.Generator().manual_seed(2))
    old = torch.tensor([0, 5, 17, 90, 300, 41])[:n, None]  # [n, 1]
    new = torch.tensor([3, 1, 17, 2, far, 40])[:n, None]  # one token stays (Δ = 0), some move far
    at_old, at_new = cached_keys(model, ids, old), cached_keys(model, ids, new)
    rr = Rerotator(model)
    delta = (new - old)[:, 0]  # [n] int64
    for layer, (ko, kn) in enumerate(zip(at_old, at_new)):
        got = rr(layer, ko[:, :, 0].transpose(0, 1), delta)  # [n, H, 1, D] -> [H, n, D]
        assert got.dtype == ko.dtype
        torch.testing.assert_close(got.float(), kn[:, :, 0].transpose(0, 1).float(), atol=atol, rtol=atol,
                                   msg=lambda m, layer=layer: f"layer {layer}: {m}")


@pytest.mark.parametrize("model_type", list(ROTARY))
def test_rerotated_keys_equal_the_models_own_keys(model_type):
    overrides, layout = ROTARY[model_type]
    model = build(model_type, **overrides)
    assert rerotation_refusal(model) is None
    got = [None if s is None else (s.rotary_dim, s.interleaved) for s in rope_layout_or_reason(model)]
    assert got == layout
    check_sequence(model, p0=3, delta=50)
    check_sequence(model, p0=200, delta=-197)
    check_per_token(model)


@pytest.mark.parametrize("scaling", list(SCALED))
def test_fixed_frequency_scalings_are_rerotated_exactly(scaling):
    model = build("llama", rope_parameters={"rope_theta": 10_000.0, **SCALED[scaling]})
    assert model.model.rotary_emb.rope_type == scaling
    if scaling == "yarn":  # cos/sin carry the attention factor: it is in the cached keys and must not be re-applied
        assert model.model.rotary_emb.attention_scaling > 1.05
    assert rerotation_refusal(model) is None
    check_sequence(model, p0=10, delta=300)
    check_per_token(model)


def test_gemma3_layer_types_use_their_own_frequencies():
    model = build("gemma3_text", **ROTARY["gemma3_text"][0])
    layout = rope_layout_or_reason(model)
    rot = model.model.rotary_emb
    for layer, kind in enumerate(GEMMA3_TYPES):
        assert torch.equal(layout[layer].inv_freq, getattr(rot, f"{kind}_inv_freq").double())
    assert not torch.equal(layout[0].inv_freq, layout[1].inv_freq)


def test_delta_zero_and_nope_layers_leave_keys_untouched():
    model = build("smollm3", num_hidden_layers=4)
    rr = Rerotator(model)
    k = torch.randn(2, 5, 16)
    assert rr(0, k, torch.zeros(5, dtype=torch.int64)) is k
    assert rr(3, k, torch.arange(5)) is k  # layer 3 has no RoPE
    assert not torch.equal(rr(0, k, torch.arange(5)), k)


def test_bfloat16_model_uses_its_own_rounded_frequencies():
    # model.to(bfloat16) rounds the inv_freq buffer too, and the model rotates with those rounded values: so
    # must we (frequencies rebuilt from the config in float32 would be ~0.6 rad off at Δ = 3700)
    model = build("llama").to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    check_per_token(model, atol=2e-2, far=4000)


NO_ROPE = {
    "gpt2": ({"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}, "absolute position"),
    "bloom": ({"hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}, "ALiBi"),
    "mpt": ({"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256}, "ALiBi"),
}
LENGTH_DEPENDENT = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                 "original_max_position_embeddings": 128},
}


def assert_refused(model, *words: str) -> None:
    reason = rerotation_refusal(model)
    assert reason and "\n" not in reason
    assert all(w in reason for w in words), reason
    with pytest.raises(ValueError) as e:
        Rerotator(model)
    assert str(e.value) == reason


@pytest.mark.parametrize("model_type", list(NO_ROPE))
def test_models_without_rope_are_refused(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw, word = NO_ROPE[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    assert_refused(model, model_type, "no rotary position embedding", word)


@pytest.mark.parametrize("scaling", list(LENGTH_DEPENDENT))
def test_length_dependent_scalings_are_refused(scaling):
    model = build("llama", rope_parameters={"rope_theta": 10_000.0, **LENGTH_DEPENDENT[scaling]})
    assert_refused(model, scaling, "sequence length")


def test_unknown_rotary_modules_and_conditions_are_refused():
    # gpt-j: its own rotary helper (sin/cos table, rotate_every_two), not a transformers RoPE module
    gptj = build("gptj", n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
    assert_refused(gptj, "gptj")
    # falcon: RoPE under `if alibi is None` (a forward argument): which layers rotate cannot be read
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        falcon = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256))
    assert_refused(falcon, "falcon", "alibi is None")
    # (DeepSeek's MLA, refused here before, is re-rotated on its cached rotary key: tests/engine/test_layer_policies.py)


def test_refusal_is_cached_and_runs_no_forward():
    model = build("smollm3", num_hidden_layers=4)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *a: calls.append(1))
    assert rerotation_refusal(model) is None
    t = time.perf_counter()
    for _ in range(1000):
        rerotation_refusal(model)
    assert time.perf_counter() - t < 0.1
    assert rope_layout_or_reason(model) is rope_layout_or_reason(model)
    assert not calls


def test_attention_module_still_exports_rerotator():
    assert RerotatorFromAttention is Rerotator
