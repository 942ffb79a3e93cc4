"""The built-in ``demo`` model: a seeded random-weight Llama with a byte-level tokenizer made in code.

No files and no network, so the app and every cache mode can run anywhere. Its text is meaningless
(random weights, labelled as such); its shapes are real: 4 layers, GQA 8 query / 2 KV heads, head dim 16.
Logits of non-printable bytes are zeroed in the output head so the demo writes readable characters.
"""

from __future__ import annotations

import torch

DEMO_SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_demo_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(DEMO_SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  additional_special_tokens=DEMO_SPECIALS[3:])
    tok.chat_template = DEMO_CHAT_TEMPLATE
    return tok


def build_demo(seed: int = 1234):
    """(model, tokenizer) of the demo, float32 on CPU. Deterministic for a given seed."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = build_demo_tokenizer()
    vocab_size = len(tok)
    end_id = tok.convert_tokens_to_ids("<|end|>")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=[2, end_id],
        attn_implementation="sdpa",
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    printable = set(range(0x20, 0x7F)) | {0x0A}
    from tokenizers import pre_tokenizers

    byte_chars = {ch: b for b, ch in _bytes_to_unicode().items()}
    with torch.no_grad():
        for tok_str, tid in tok.get_vocab().items():
            b = byte_chars.get(tok_str)
            if b is None or b not in printable:
                model.lm_head.weight[tid].zero_()
    del pre_tokenizers
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, end_id], do_sample=False)
    model.eval()
    return model, tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable-character map (what ByteLevel pre-tokenization uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))
