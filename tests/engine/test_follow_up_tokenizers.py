"""Follow-ups reuse the reply on real SentencePiece tokenizers (#49 item 5): over the API with the reply's text sent
back, as every client does, the next prompt finds the previous prompt and reply in the cache. Phi-3's tokenizer
and template reused 27-65% before: a reply's first token "▁Hello" was decoded alone ("Hello", its space gone),
the template rendered "\\nHello", which tokenizes to other ids, and the whole reply was computed again.

Real vocabularies (llama.cpp's vocab-only GGUF files, ``tests/data/vocab``, read by transformers' GGUF tokenizer
conversion), a tiny random-weight Llama of each vocabulary's size, the real server over real HTTP."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import httpx
import pytest

from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread

VOCAB = Path(__file__).resolve().parents[1] / "data" / "vocab"
PLAIN = ("{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + ']' + m['content'] + '\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}")  # Llama's vocabulary ships no template
TURNS = ["Tell me a story about a fox.", "And then what happened?", "Why did it do that?",
         "Ünïcödé and emoji 🦊 too: what now?"]


def _folder(tmp: Path, name: str) -> Path:
    """A model folder: the vocabulary's tokenizer (converted from the GGUF) and a tiny random Llama as wide."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = tmp / f"ggml-vocab-{name}.gguf"
    with gzip.open(VOCAB / f"ggml-vocab-{name}.gguf.gz") as src, open(gguf, "wb") as dst:
        shutil.copyfileobj(src, dst)
    tok = AutoTokenizer.from_pretrained(str(tmp), gguf_file=gguf.name)
    if not tok.chat_template:
        tok.chat_template = PLAIN
    folder = tmp / name
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["phi-3", "llama-spm"])
def served(request, tmp_path_factory):
    from engine.model.loader import load_model

    folder = _folder(tmp_path_factory.mktemp("vocab"), request.param)
    server = KVServer(load_model(str(folder)), CacheConfig(page_size=16), ServerOptions(), source=str(folder))
    thread = ServerThread(server)
    url = thread.start()
    yield request.param, url
    thread.stop()


def test_a_follow_up_reuses_the_prompt_and_the_reply(served):
    name, url = served
    convo: list[dict] = []
    reuse = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for turn, text in enumerate(TURNS):
            convo.append({"role": "user", "content": text})
            r = c.post("/v1/chat/completions", json={"model": name, "messages": convo, "max_tokens": 40,
                                                     "temperature": 0.8, "seed": turn})
            assert r.status_code == 200, r.text
            body = r.json()
            if turn:
                cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                reuse.append(cached / was)
                misses = body["kvscope"]["cache"]["misses"]
                assert [m["reason"] for m in misses] == ["new"], (name, turn, misses)  # only the new message
            was = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
            convo.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert min(reuse) >= 0.95, (name, reuse)


def test_without_keys_a_changed_word_is_told_where_it_diverged(served):
    """One user (no API keys): nothing is hidden from it, so a prompt that changes a word of the conversation is
    reused up to that token and the account says ``diverged`` there (it read ``partial_page`` from the page's start)."""
    name, url = served
    first = [{"role": "user", "content": "Tell me a long story about a red fox who lived in a quiet forest by a river."}]
    with httpx.Client(base_url=url, timeout=120) as c:
        c.post("/v1/chat/completions", json={"model": name, "messages": first, "max_tokens": 8, "temperature": 0})
        changed = [{"role": "user", "content": first[0]["content"].replace("quiet", "noisy")}]
        body = c.post("/v1/chat/completions", json={"model": name, "messages": changed, "max_tokens": 1,
                                                    "temperature": 0}).json()
    misses = body["kvscope"]["cache"]["misses"]
    assert misses[0]["reason"] == "diverged", misses
    reused = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert misses[0]["start"] == reused and "partial_page" not in [m["reason"] for m in misses]
    assert reused > 16  # to the changed word, past the first page
