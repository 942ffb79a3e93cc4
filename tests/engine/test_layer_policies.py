"""Eviction policies on models whose layers differ (#35 item 1): StreamingLLM, H2O, Expected Attention, priority and the evicting
overflow modes on sliding-window models (Gemma 2/3, gpt-oss, EXAONE 4, Cohere 2), hybrids with recurrent /
convolution state (LFM2, Falcon-H1, Qwen3-Next) and DeepSeek's multi-head latent attention.

Tiny seeded random models of the real transformers classes (``arch_zoo``'s configs), float32. Where the method
is lossless the tokens equal HF greedy ``generate``: before the budget is reached, and on the layer kinds the
eviction does not approximate — a model whose full-attention layers are silenced (``o_proj`` zero) computes
only with its sliding / state layers, so StreamingLLM past its budget must still give HF's tokens exactly:
that is what shifting the windows' keys with the positions (and leaving the states alone) promises.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import arch_zoo
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.core import eviction
from engine.core.session import ChatSession
from engine.kv.store.rope import Rerotator, keyless_layers, rerotation_refusal, rope_layout_or_reason
from engine.model.loaded import wrap_model

SLIDING = ["gemma2", "gemma3_text", "gpt_oss", "exaone4", "cohere2"]
STATES = ["lfm2", "falcon_h1", "qwen3_next"]
MLA = ["deepseek_v3", "deepseek_v2"]
TYPES = SLIDING + STATES + MLA
STREAMING = CacheConfig(mode="paged", page_size=4, policy="streaming", policy_params={"sinks": 4, "window": 20})
POLICIES = {
    "streaming": STREAMING,
    "h2o": CacheConfig(mode="paged", page_size=4, policy="h2o", policy_params={"budget": 24, "recent": 8}),
    "priority": CacheConfig(mode="paged", page_size=4, policy="priority", policy_params={"budget": 24}),
    "expected": CacheConfig(mode="paged", page_size=4, policy="expected",
                            policy_params={"budget": 24, "recent": 8, "sinks": 2, "queries": 16}),
}
IDS = list(range(5, 25))


def tiny(model_type: str, **overrides):
    """(model, lm): ``arch_zoo``'s tiny config of ``model_type`` with ``overrides``, seeded, float32, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type, **{**arch_zoo.tiny_kwargs(model_type), **overrides})
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
        except ValueError:  # softcapping (gemma2), attention sinks (gpt-oss): eager only
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    return model, wrap_model(model, None, ModelSpec(source="test"), "cpu", "CPU", name=model_type, path=None,
                             is_demo=True)


def silence_full_attention(model, lm) -> None:
    """Zero the output projection of every full-attention layer: the model then computes with its sliding /
    state layers (and MLPs) only, which the eviction must leave exact."""
    layers = model.get_decoder().layers
    with torch.no_grad():
        for i, kind in enumerate(lm.info.layer_kinds):
            if kind.split("+")[0] == "full":
                attn = next(getattr(layers[i], n) for n in ("self_attn", "attention") if hasattr(layers[i], n))
                out = next(getattr(attn, n) for n in ("o_proj", "out_proj") if hasattr(attn, n))
                out.weight.zero_()
                if getattr(out, "bias", None) is not None:
                    out.bias.zero_()


def hf_greedy(model, ids, n, logprobs: bool = False):
    """HF's greedy tokens (and, with ``logprobs``, each chosen token's log-probability)."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    if not logprobs:
        return tokens
    return tokens, [torch.log_softmax(sc[0].float(), -1)[t].item() for sc, t in zip(out.scores, tokens)]


def run(s: ChatSession, ids, n, logprobs: list | None = None):
    """(generated ids, the notes of the reply, the highest RoPE position handed to the model, last snapshot);
    each chosen token's log-probability appended to ``logprobs`` if given."""
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True, logprobs=0 if logprobs is not None else None))
    notes, top = [], 0
    while True:
        r = s.step()
        top = max(top, s.index.next_rope - 1)  # the last position fed
        notes += [str(w) for w in (r.warnings or ())]
        last = s.turn_state.sampler.last_logprobs
        if logprobs is not None and last is not None and len(logprobs) < len(s.generated_ids):
            logprobs.append(last[0])
        if r.done:
            return list(s.generated_ids), notes, top, r.snapshot


@pytest.fixture(scope="module", params=TYPES)
def zoo(request):
    return (request.param, *tiny(request.param))


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_policy_runs_far_past_its_budget_and_says_what_it_did_per_layer_kind(zoo, name):
    model_type, model, lm = zoo
    s = ChatSession(lm, POLICIES[name])
    got, notes, top, snap = run(s, IDS, 64)
    assert len(got) == 64
    kinds, per_layer = lm.info.layer_kinds, snap.tokens_per_layer
    for i, kind in enumerate(kinds):
        if kind.startswith("full"):
            assert per_layer[i] <= 24  # the budget
        elif kind == "sliding":
            assert per_layer[i] <= lm.info.windows[i] - 1 + 4 - 1  # its window (pages of 4), whatever the length
    text = " ".join(notes)
    if model_type in MLA:
        assert ("only the cached rotary key (8 channels a token) is re-rotated" in text) == (name == "streaming")
    else:
        assert "full-attention layer" in text
        assert ("sliding layer" in text) == (model_type in SLIDING)
        assert ("go on over every token" in text or "goes on over every token" in text) == (model_type in STATES)
    if name == "streaming":  # in-cache positions: never past sinks + window, though 84 tokens were fed
        assert top < 24 and s.index.next_pos == 20 + 63
        if model_type in SLIDING:
            assert "keys shifted by as many positions as the queries" in text
    else:  # H2O and priority keep every key at its own position
        assert s.index.next_rope == s.index.next_pos == 20 + 63
    s.close()


def test_rolling_overflow_goes_on_past_the_context(zoo):
    model_type, _, _ = zoo
    model, lm = tiny(model_type, max_position_embeddings=40)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, overflow="rolling"))
    got, _, top, _ = run(s, IDS, 60)
    assert len(got) == 60 and top < 40 and s.index.next_pos == 20 + 59  # positions restarted below the context
    s.close()


@pytest.mark.parametrize("name", list(POLICIES))
def test_below_the_budget_every_policy_is_exact(zoo, name):
    model_type, model, lm = zoo
    cfg = POLICIES[name]
    roomy = {"streaming": {"sinks": 4, "window": 200}, "h2o": {"budget": 200, "recent": 8}, "priority": {"budget": 200},
             "expected": {"budget": 200, "recent": 8}}
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, policy=cfg.policy, policy_params=roomy[name]))
    got, _, _, _ = run(s, IDS, 24)
    assert got == hf_greedy(model, IDS, 24)
    s.close()


@pytest.mark.parametrize("model_type", SLIDING + STATES)
def test_sliding_and_state_layers_stay_exact_through_streaming_evictions(model_type, monkeypatch):
    # the full-attention layers silenced: what is left is what StreamingLLM does not approximate on these models,
    # so its tokens past the budget (positions handed to the model moved back every few steps) are HF's own
    model, lm = tiny(model_type)
    silence_full_attention(model, lm)
    want, want_lp = hf_greedy(model, IDS, 48, logprobs=True)
    s = ChatSession(lm, STREAMING)
    lp: list[float] = []
    got, _, top, _ = run(s, IDS, 48, lp)
    assert top < 24 < s.index.next_pos  # in-cache positions
    assert got == want
    exact = max(abs(a - b) for a, b in zip(lp, want_lp))
    assert exact < 1e-5  # float32 rounding (~3e-7 measured)
    s.close()
    if model_type in SLIDING:  # and the shift is what keeps the windows exact: without it they drift
        monkeypatch.setattr(eviction, "shift_all", lambda *a: None)
        s = ChatSession(lm, STREAMING)
        lp = []
        run(s, IDS, 48, lp)
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) > 5e-5  # 1.3e-4 (cohere2) .. 0.25 (gemma3) measured
        s.close()


def test_a_regenerate_after_shifted_windows_does_not_reuse_them():
    # windows larger than the budget: when StreamingLLM first evicts, the window still holds the chat from token
    # 0 (no page slid out yet), its keys shifted; cutting it back to the sinks for a regenerate must not reuse them
    model, lm = tiny("gemma3_text", sliding_window=64)
    cfg = CacheConfig(mode="paged", page_size=4, policy="streaming", policy_params={"sinks": 2, "window": 10})
    s = ChatSession(lm, cfg)
    first, _, _, _ = run(s, IDS, 20)
    assert s.index.intact == 0  # the windows' keys moved: no prefix is at its own positions
    again, _, _, _ = run(s, IDS, 20)
    assert again == first
    s.close()


@pytest.mark.parametrize("model_type,over", [("deepseek_v3", {}), ("deepseek_v3", {"rope_interleave": False}),
                                             ("deepseek_v2", {}), ("minicpm3", {})])
def test_mla_rotary_key_is_rerotated_exactly(model_type, over):
    from transformers import DynamicCache

    model, lm = tiny(model_type, **over)
    assert rerotation_refusal(model) is None
    layout = rope_layout_or_reason(model)
    assert {(s.rotary_dim, s.role) for s in layout} == {(8, "v")}  # MLA caches k_rot as its "value"
    rr = Rerotator(model)
    assert rr.role == "v"
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    for p0, delta in ((3, 50), (200, -197)):
        cached = []
        for p in (p0, p0 + delta):
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model(input_ids=ids, position_ids=torch.arange(p, p + 7)[None], cache=cache, use_cache=True)
            cached.append([(layer.keys, layer.values) for layer in cache.layers])
        d = torch.full((7,), delta, dtype=torch.int64)
        for layer, ((lat_p, rot_p), (lat_q, rot_q)) in enumerate(zip(*cached)):
            torch.testing.assert_close(lat_p, lat_q)  # the latent carries no position
            torch.testing.assert_close(rr(layer, rot_p[0], d), rot_q[0], atol=1e-5, rtol=1e-5)


def test_rope_layouts_skip_the_layers_that_cache_no_keys():
    for model_type, want in (("lfm2", [None, (16, "k")]), ("qwen3_next", [None, (4, "k")]),
                             ("jamba", [None, None])):  # Jamba's attention has no RoPE: nothing moves
        model, lm = tiny(model_type)
        keyless = keyless_layers(lm.info.layer_kinds)
        assert rerotation_refusal(model) is not None  # read as if every layer held keys: refused
        got = [None if s is None else (s.rotary_dim, s.role) for s in rope_layout_or_reason(model, keyless)]
        assert got == want


def test_what_still_cannot_run_says_why_in_one_line():
    _, lm = tiny("mistral")  # every layer slides
    for cfg, words in ((STREAMING, "every layer of this model slides"),
                       (CacheConfig(overflow="rolling"), "nothing can be evicted to go on past the context")):
        with pytest.raises(ValueError, match=words) as e:
            ChatSession(lm, cfg)
        assert "\n" not in str(e.value)
