"""Tiny random-weight models with real tool-calling chat templates and a real tokenizer, for the agent tests.

The tokenizer is Qwen2.5's (``data/qwen25_tokenizer.json.xz``: 151,665 tokens, ``<tool_call>`` one token), the
templates are the models' published ones (``data/chat_templates``). The weights are random (a Qwen2 of 2 layers,
hidden size 64): such a model never writes a valid call by itself, so free replies are read as text and calls are
forced by the grammar (``tool_choice`` required / named), or parsed from text a test writes.
"""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data"
TEMPLATES = DATA / "chat_templates"
QWEN_VOCAB = 151936  # Qwen2.5's embedding rows (the tokenizer's 151,665 ids, padded)


def template(name: str) -> str:
    """A published chat template's text: ``qwen2.5``, ``llama3.1``, ``mistral-nemo``, ``ministral3``, ``gpt-oss``,
    ``hermes3``, ``gemma4``."""
    files = {"qwen2.5": "Qwen-Qwen2.5-7B-Instruct", "llama3.1": "meta-llama-Llama-3.1-8B-Instruct",
             "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407",
             "ministral3": "mistralai-Ministral-3-14B-Reasoning-2512", "gpt-oss": "openai-gpt-oss-120b",
             "hermes3": "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "gemma4": "google-gemma-4-31B-it"}
    return (TEMPLATES / f"{files[name]}.jinja").read_text()


def qwen_tokenizer_file(folder: Path) -> Path:
    out = Path(folder) / "tokenizer.json"
    if not out.exists():
        out.write_bytes(lzma.decompress((DATA / "qwen25_tokenizer.json.xz").read_bytes()))
    return out


def qwen_tokenizer(folder: Path, chat_template: str | None = None):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(qwen_tokenizer_file(folder)), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = chat_template if chat_template is not None else template("qwen2.5")
    return tok


def save_qwen_folder(folder: Path, chat_template: str | None = None, seed: int = 0) -> Path:
    """A model folder ``load_model`` reads: a random 2-layer Qwen2 over Qwen2.5's vocabulary, the tokenizer and
    ``chat_template`` (Qwen2.5's by default)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = [151645, 151643]
    model.save_pretrained(folder)
    tok = qwen_tokenizer(folder, chat_template)
    tok.save_pretrained(folder)
    return folder


def copy_folder(src: Path, dst: Path, chat_template: str) -> Path:
    """``src`` with another chat template (the weights and tokenizer shared by copy)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    (Path(dst) / "chat_template.jinja").write_text(chat_template)
    return Path(dst)
