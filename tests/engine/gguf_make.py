"""GGUF files for the tests, written in-process with the ``gguf`` package's writer from a transformers model.

What llama.cpp's ``convert_hf_to_gguf.py`` does for the three shapes tested (llama, qwen2, gemma2), in the part that
matters for a file transformers reads back: tensor names from ``gguf.TensorNameMap``, Llama's q/k rows permuted to
llama.cpp's rotary layout (transformers permutes them back), Gemma's norms stored as ``1 + w`` (llama.cpp multiplies
by the weight, Gemma by one plus it), hyperparameters under ``{arch}.*``, a SentencePiece vocabulary (stories260K's
``tokenizer.model``) with scores and token types, a chat template. ``qtype`` Q8_0 quantizes every 2-D weight whose
rows are whole 32-value blocks with ``gguf.quants`` (stories260K's 172-wide MLP rows stay F32, as llama.cpp's
converter leaves them), norms stay F32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def random_model(arch: str, **config):
    """A float32 causal LM of ``arch`` with ``config``, random weights from seed 0 (the global generator left as it
    was), eager attention: the model the GGUF tests write and compare against."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for a q/k projection of ``n_head`` heads: (rows, in) → same shape, the two rotary
    halves of each head interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(tokenizer_model: Path) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and llama.cpp token types (1 normal, 2 unknown, 3 control, 6 byte) of a SentencePiece model."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        pieces.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    return pieces, scores, types


def _tensor(writer, name: str, data: np.ndarray, qtype: str) -> None:
    import gguf

    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == "Q8_0" and data.ndim == 2 and data.shape[-1] % 32 == 0:
        kind = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    else:
        writer.add_tensor(name, data)


def _hyperparameters(writer, arch: str, cfg, n_ctx: int) -> None:
    writer.add_name(f"kvscope-test-{arch}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)
    writer.add_rope_freq_base(float(rope))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "gemma2":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _bpe(writer, tokens: list[str], merges: list[str], control: int) -> None:
    """A byte-level BPE vocabulary (llama.cpp's "gpt2" model, as Llama-3's and Qwen2's files): ``tokens`` in the
    byte alphabet, the last ``control`` of them control tokens (the first two: BOS, EOS)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - control) + [3] * control)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - control)
    writer.add_eos_token_id(len(tokens) - control + 1)


def write_gguf(model, arch: str, tokenizer_model: Path | None, path: Path, qtype: str = "F32",
               chat_template: str | None = CHAT_TEMPLATE, bpe: tuple[list[str], list[str], int] | None = None) -> Path:
    """Write ``model`` (a float32 transformers causal LM of type ``arch``) with the vocabulary of ``tokenizer_model``
    (or ``bpe``: byte-level tokens, merges and how many control tokens end the list) to ``path`` as GGUF; ``qtype``
    "F32" or "Q8_0". Returns ``path``."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _hyperparameters(writer, arch, cfg, int(cfg.max_position_embeddings))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    if bpe is not None:
        _bpe(writer, *bpe)
        _weights(writer, model, arch, qtype)
        return path
    pieces, scores, types = _vocab(tokenizer_model)
    bos, eos, unk = 1, 2, 0
    if arch == "gemma2":  # Gemma's special pieces where its vocabulary has them (its tokenizer adds any missing)
        pieces[:5] = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
        types[:5] = [3, 3, 3, 2, 3]
        bos, eos, unk = 2, 1, 3
        writer.add_pad_token_id(0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(unk)
    writer.add_add_bos_token(True)
    if chat_template:
        writer.add_chat_template(chat_template)
    _weights(writer, model, arch, qtype)
    return path


def gguf_tensors(model, arch: str):
    """(llama.cpp's name, the Hugging Face name, float32 array as llama.cpp's converter writes it) for each of the
    model's tensors: Llama's Q / K rows permuted, Gemma 2's norms +1, a tied output head left out."""
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue  # tied: GGUF keeps the embedding only (no output.weight ⇒ transformers ties them again)
        data = t.detach().float().numpy()
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, cfg.num_key_value_heads)
        if arch == "gemma2" and hf_name.endswith("norm.weight"):
            data = data + 1.0
        yield name, hf_name, data


def close(writer) -> None:
    """The header, settings and tensors written, the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _weights(writer, model, arch: str, qtype: str) -> None:
    """The model's tensors under llama.cpp's names, then the file written and closed."""
    for name, _, data in gguf_tensors(model, arch):
        _tensor(writer, name, data, qtype)
    close(writer)
