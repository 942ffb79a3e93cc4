"""Tiny configurations of every causal-LM type in transformers 5.24 (the table behind ``arch_zoo``).

``GENERIC`` shrinks the fields most configs share; a field is only passed when the type's config has it
(directly or through its ``attribute_map``), so one table serves all types. ``OVERRIDES`` adds what a type
needs on top: a ``layer_types`` pattern holding every layer kind the architecture has, dimensions that must
agree with each other (MLA ranks, mamba heads x head dim = expand x hidden), and fields with other names.
``SKIPPED`` lists the mapping's types that are not plain text decoders, with the reason.
"""

from __future__ import annotations

# Short window: a 32-64 token generation must really slide past it.
WINDOW = 8

GENERIC: dict[str, object] = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, max_position_embeddings=512,
    # other names of the MLP width (opt/xglm ffn_dim, ctrl dff, minimax/nemotron/granite dense and shared MLPs)
    ffn_dim=128, dff=128, dense_intermediate_size=128, intermediate_size_mlp=128,
    # MoE: few small experts, top-2, no expert groups
    shared_intermediate_size=32, shared_experts_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    expert_ffn_hidden_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=32, n_routed_experts=4, num_experts=4,
    num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_topk=2, n_group=1, topk_group=1,
    # MLA (DeepSeek-style): head_dim is the rotary part there, so it is set to qk_rope_head_dim below
    kv_lora_rank=32, q_lora_rank=32, o_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=24,
    # linear attention (gated delta net and friends)
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_head_dim=16, linear_num_heads=4,
    # mamba / mamba2: n_heads x d_head = expand(2) x hidden(64)
    mamba_d_state=8, mamba_n_heads=8, mamba_d_head=16, mamba_chunk_size=16, ssm_state_size=8, mamba_num_heads=8,
    mamba_head_dim=16, time_step_rank=8, mamba_dt_rank=8,
    # DSA indexers (DeepSeek V3.2, GLM-DSA): top-k below the generated length so the sparsity is real
    index_head_dim=16, index_n_heads=2, index_topk=16,
    # an lm_head of its own: with the embedding tied to it, a tiny random model mostly repeats its input token
    # (40 of the types gave <= 3 distinct tokens in 64), which a broken cache would repeat just as well
    tie_word_embeddings=False,
)

_ENC_DEC = "decoder half of an encoder-decoder model (cross-attention to encoder states)"
_DUP = "multimodal wrapper; its text decoder is covered as {}"
SKIPPED: dict[str, str] = {
    **{t: _ENC_DEC for t in ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
                             "pegasus", "plbart", "prophetnet")},
    "trocr": "decoder of a vision encoder-decoder (image to text)",
    "whisper": "audio: decoder of a speech encoder-decoder",
    "musicgen": "audio: decoder of a text-to-music encoder-decoder (codebook streams)",
    "musicgen_melody": "audio: decoder of a text-to-music encoder-decoder (codebook streams)",
    "moshi": "audio: speech model with a depth decoder over audio codebooks",
    "moss_transcribe_diarize": "audio: speech transcription model",
    "gemma3": _DUP.format("gemma3_text"),
    "gemma3n": _DUP.format("gemma3n_text"),
    "gemma4": _DUP.format("gemma4_text"),
    "gemma4_unified": _DUP.format("gemma4_unified_text"),
    "llama4": _DUP.format("llama4_text"),
    "qwen3_5": _DUP.format("qwen3_5_text"),
    "qwen3_5_moe": _DUP.format("qwen3_5_moe_text"),
    "qwen4_exp": _DUP.format("qwen4_exp_text"),
    "dots3_note": _DUP.format("dots3_note_text"),
    "fuyu": "multimodal: image patches fed to a persimmon decoder (covered as persimmon)",
    "got_ocr2": "multimodal: OCR model (vision tower + qwen2 decoder, covered as qwen2)",
    "emu3": "multimodal: image-token generation model (VQ tokenizer + llama-like decoder, covered as llama)",
    "mllama": "multimodal: text decoder with cross-attention layers to image states",
    "git": "multimodal: image-captioning decoder (image embeddings as prefix)",
    "phi4_multimodal": "multimodal: phi3 decoder with vision/audio LoRA adapters (covered as phi3)",
    "gemma4_assistant": "speculative-decoding drafter: every layer reads the target model's KV (no own cache)",
    "gemma4_unified_assistant": "speculative-decoding drafter: every layer reads the target model's KV (no own cache)",
    "xlnet": "permutation LM with segment memory (mems), not a KV cache",
    "blt": ("byte latent transformer (entropy patcher, local encoder/decoder cross-attending to patches); in 5.24 "
            "its own forward with use_cache=True fails: DynamicCache(config=BltConfig) finds no num_hidden_layers"),
    "xlm": ("generate() appends a <mask> token every step and predicts it (MLM-style generation), so HF's greedy "
            "loop is not a causal decode; its cache is a dict of its own"),
    "reformer": "LSH / chunked-local attention caching hidden states and hash buckets, not K/V",
}

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

_INKLING = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, rel_extent=16)

# BERT-family LM heads are only causal with is_decoder=True; without it the prompt is encoded bidirectionally
# and a full recompute differs from cached decoding (transformers warns "add `is_decoder=True`")
ENCODER_AS_DECODER = ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                      "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
                      "xlm-roberta", "xlm-roberta-xl", "xmod")

OVERRIDES: dict[str, dict] = {
    # partial rotary through rotary_dim (half of head_dim 16)
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    # per-layer-type RoPE table, keyed by the layer kinds
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2,
                                rope_parameters={"sliding_attention": _ROPE, "full_attention": _ROPE}),
    # attention and FFN settings live in sub-configs
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
    "dots1": dict(n_shared_experts=1),
    # mamba2 mixer: n_heads x d_head == d_ssm
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16),
    # alternating global/local (window) attention
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=8, chunk_size=16, n_groups=1),
    "zaya": dict(num_experts_per_tok=1, layer_types=["hybrid", "hybrid_sliding"], num_hidden_layers=2,
                 sliding_window=WINDOW),
    # zamba: "hybrid" = a mamba layer preceded by the shared attention block
    # (with a single hybrid layer transformers 5.24 fails to tie the shared block: two of them)
    "zamba": dict(n_mamba_heads=2, layers_block_type=["linear_attention", "hybrid", "hybrid"], num_hidden_layers=3),
    "zamba2": dict(n_mamba_heads=8),
    # attention at the layer indices given, mamba elsewhere
    "bamba": dict(attn_layer_indices=[1], num_hidden_layers=2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_hidden_layers=2),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2),
    # num_hidden_layers is derived as 2 x num_layers (two attention sublayers per block)
    # (zero_expert_num: identity "zero-compute" experts added to the router)
    "longcat_flash": dict(num_layers=1, zero_expert_num=4),
    # QSA indexer on the indexed layers; hyper-connections low rank
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4, hc_lowrank=8),
    # heterogeneous MLA: the sliding layer has its own heads and latent rank (and head_dim = nope + rope)
    "dots3_note_text": dict(head_dim=24, per_layer_config={"1": {"num_attention_heads": 2, "num_key_value_heads": 2,
                                                                 "kv_lora_rank": 48}}),
    "lfm2": dict(layer_types=["conv", "full_attention"], num_hidden_layers=2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_hidden_layers=2, num_dense_layers=1),
    # chunked attention: a window that restarts at every multiple of the chunk size; the full layer is NoPE
    "llama4_text": dict(attention_chunk_size=WINDOW, layer_types=["chunked_attention", "full_attention"],
                        num_hidden_layers=2, no_rope_layers=[1, 0]),
    # NoPE layers (0 = no rotary on that layer)
    "smollm3": dict(no_rope_layers=[1, 0]),
    # Falcon-40B/180B layout: GQA through num_kv_heads (the 7B default is multi-query)
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    # V narrower than K (head_dim 16, v_head_dim 8), partial rotary per layer type
    "mimo_v2_flash": dict(v_head_dim=8),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], num_hidden_layers=2, lru_width=64),
    # the full-attention layers have their own (wider) head_dim; per-layer input embeddings kept tiny;
    # gemma4_text also shares KV like the E2B/E4B checkpoints (last 2 layers read earlier layers' KV)
    "gemma4_text": dict(global_head_dim=32, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
                        layer_types=["sliding_attention", "full_attention"] * 2, num_hidden_layers=4,
                        num_kv_shared_layers=2),
    "gemma4_unified_text": dict(global_head_dim=32, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8),
    # KV sharing: the last 2 layers read the KV of earlier layers of their kind
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_hidden_layers=4,
                         num_kv_shared_layers=2, intermediate_size=[128] * 4, activation_sparsity_pattern=[0.0] * 4,
                         vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, laurel_rank=8),
    # hierarchical reasoning model: H/L stacks run in cycles, one cache layer per attention call
    # (num_hidden_layers becomes layers x H_cycles x (L_cycles + 1)); the prompt attends bidirectionally (prefix LM)
    "hrm_text": dict(num_hidden_layers=1, H_cycles=2, L_cycles=1),
    # extra embedding tables (pronunciation/shape vocabularies; factorised input/output embeddings)
    "roc_bert": dict(pronunciation_vocab_size=32, shape_vocab_size=32, pronunciation_embed_dim=16, shape_embed_dim=16),
    "rembert": dict(input_embedding_size=32, output_embedding_size=64),
    # cpmant prepends prompt_length learned prompt tokens to every input (they are cached too)
    "cpmant": dict(dim_head=16, dim_ff=128, position_bias_num_buckets=32, position_bias_max_distance=128,
                   prompt_length=4),
    # looped ("recurrent depth") layers: the middle layer runs twice, with one KV cache per loop
    "dory": dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_hidden_layers=3,
                 n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2,
                 recurrent_kv_cache_mode="per_loop"),
    # hybrid (short conv + attention) layers; the sliding ones have their own head counts
    "inkling_text": dict(**_INKLING),
    "inkling2_text": dict(**_INKLING, unpadded_vocab_size=256, n_layers_per_attn_res_block=1),
    "inkling2_loop_text": dict(**_INKLING, unpadded_vocab_size=256, n_layers_per_attn_res_block=1,
                               loop_layer_index_start=1, loop_layer_index_end=2),
    "xlstm": dict(num_heads=4, embedding_dim=64, num_blocks=2, chunk_size=16, qk_dim_factor=1.0),
}
for _t in ENCODER_AS_DECODER:
    OVERRIDES.setdefault(_t, {})["is_decoder"] = True
# still near-constant greedy output at the default init (<= 8 distinct tokens in 64): larger random weights
for _t in ("bitnet", "diffllama", "inkling2_loop_text", "phi3", "qwen3_5_text", "roformer"):
    OVERRIDES.setdefault(_t, {})["initializer_range"] = 0.2
