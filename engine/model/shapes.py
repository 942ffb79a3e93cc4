"""Random-weight models of real configurations, for speed measurements without downloads.

``build_shape("smollm2-135m")`` gives a ``LoadedModel`` (no tokenizer: benchmarks feed token ids) with the
exact layer, head and vocabulary sizes of the named model and seeded random weights.
"""

from __future__ import annotations

import torch

from engine.config import ModelSpec
from engine.model.loaded import LoadedModel, wrap_model
from engine.model.loader import choose_device

SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M: Llama, GQA 9/3, head_dim 64
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    # Qwen/Qwen2.5-0.5B: Qwen2, GQA 14/2, head_dim 64, attention biases
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, use_sliding_window=False),
    # google/gemma-3-1b: 26 layers, 5 sliding (window 512) : 1 full, MQA 4/1, head_dim 256 (vocabulary cut
    # from 262,144 to 16,384 so that the logits do not dominate a CPU measurement of the cache)
    "gemma3-1b": dict(arch="gemma3_text", vocab_size=16384, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      sliding_window=512, max_position_embeddings=32768, rope_theta=1000000.0,
                      rope_local_base_freq=10000.0, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
                      layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
                      tie_word_embeddings=True),
    # openai/gpt-oss-20b's attention: 24 layers alternating sliding (window 128) / full, GQA 64/8, head_dim 64,
    # learned sinks; the mixture of experts cut to 2 small experts (the cache does not see them) and the
    # vocabulary to 16,384, so that it runs on a laptop CPU
    "gpt-oss-20b-attn": dict(arch="gpt_oss", vocab_size=16384, hidden_size=2880, intermediate_size=512,
                             num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                             sliding_window=128, num_local_experts=2, num_experts_per_tok=1,
                             max_position_embeddings=131072, layer_types=["sliding_attention", "full_attention"] * 12,
                             tie_word_embeddings=False),
    # LiquidAI/LFM2-350M: 16 layers, 10 short-convolution (a fixed state) and 6 full attention, GQA 16/8 (vocabulary
    # cut from 65,536 to 16,384 as above)
    "lfm2-350m": dict(arch="lfm2", vocab_size=16384, hidden_size=1024, intermediate_size=6656, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5,
                      conv_L_cache=3, rope_theta=1000000.0, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                      block_auto_adjust_ff_dim=True, tie_word_embeddings=True,
                      layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                                   "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
                                   "full_attention", "conv"]),
    # small shapes with the same structure, for tests
    "tiny-llama": dict(arch="llama", vocab_size=320, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny-llama-hd64": dict(arch="llama", vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny-qwen2": dict(arch="qwen2", vocab_size=576, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
}


def build_config(name: str):
    if name not in SHAPES:
        raise ValueError(f"shape: {name!r} is not one of {', '.join(SHAPES)}")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    params = dict(SHAPES[name])
    arch = params.pop("arch")
    cfg = AutoConfig.for_model(arch, **params)
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch]]
    return cfg


def build_shape(name: str, seed: int = 0, device: str = "auto", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A seeded random-weight model of the named shape, wrapped as a ``LoadedModel`` without tokenizer."""
    from transformers import AutoModelForCausalLM

    cfg = build_config(name)
    dev, reason = choose_device(device)
    # Built on the GPU itself when there is one: initialising a 1B model's random weights on the host took
    # most of a minute of a GPU check. (CPU and CUDA generators differ: a shape's weights depend on where
    # it was built, its structure does not.)
    with torch.random.fork_rng(devices=[]), torch.device(dev if dev == "cuda" else "cpu"):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # no sdpa for this class (Gemma 2's softcapping, gpt-oss's sinks)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
    model.to(dev).eval()
    model.generation_config.eos_token_id = None
    spec = ModelSpec(source=f"shape:{name}", device=device)
    return wrap_model(model, None, spec, dev, reason, name=f"{name} (random weights)", path=None, is_demo=True)
