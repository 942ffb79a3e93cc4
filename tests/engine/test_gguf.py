"""GGUF files through the engine (#32): real files written in the test with the ``gguf`` package's writer
(``gguf_make``) from stories260K and from random-weight llama, qwen2 and gemma2 models, in F32 and Q8_0.

Exactness: the engine's greedy tokens from a GGUF equal HF ``generate``'s from the same GGUF (transformers'
own ``from_pretrained(dir, gguf_file=...)``), and for F32 the safetensors model's. Every bad file is refused in
one line by the command line (exit 2, no traceback), before transformers opens it, and nothing is written.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from gguf_make import random_model, write_gguf  # tests/engine is on sys.path
from test_exact import engine_greedy, hf_greedy

from engine.config import CacheConfig, ModelSpec
from engine.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from engine.model.gguf_file import read_gguf
from engine.model.loader import load_model
from engine.quant import kernel

ROOT = Path(__file__).resolve().parents[2]
N = 24
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHAPES = {"llama": dict(tie_word_embeddings=False), "qwen2": dict(tie_word_embeddings=False),
          "gemma2": dict(head_dim=16, sliding_window=8, bos_token_id=2, eos_token_id=1)}
PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 79, 63, 115, 151]


def _random(arch: str):
    return random_model(arch, **{**BASE, **SHAPES[arch]})


@pytest.fixture(scope="module")
def files(tmp_path_factory, stories_path):
    """{(arch, qtype): (gguf path, the float32 model it was written from)}; 'stories' is stories260K."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("gguf")
    out = {}
    stories = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    models = {"stories": ("llama", stories), **{a: (a, _random(a)) for a in SHAPES}}
    for key, (arch, model) in models.items():
        for q in ("F32", "Q8_0"):
            out[key, q] = (write_gguf(model, arch, stories_path / "tokenizer.model", d / f"{key}-{q}.gguf", q), model)
    return out


def _hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32).eval()


class _Wrap:  # hf_greedy reads ``.model``
    def __init__(self, model):
        self.model = model


@pytest.mark.parametrize("key", ["stories", "llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_greedy_from_gguf_equals_hf(files, key, qtype, monkeypatch):
    # float activations against the kept blocks: HF's model dequantized from the same file, up to summation order
    # (the default 8-bit activations follow llama.cpp's numerics instead: tests/engine/test_gguf_blocks.py)
    monkeypatch.setenv("KVSCOPE_GGUF_ROAD", "float")
    path, source_model = files[key, qtype]
    lm = load_model(ModelSpec(source=str(path)))
    assert lm.info.name == path.name and lm.info.has_chat_template
    ref = hf_greedy(_Wrap(_hf_from_gguf(path)), PROMPT, N)
    got = engine_greedy(lm, PROMPT, N, CacheConfig(mode="paged", page_size=4))
    assert got == ref
    if qtype == "F32":  # nothing lost on the way: the safetensors model's own tokens
        assert got == hf_greedy(_Wrap(source_model), PROMPT, N)


def test_stories_gguf_tokenizer_and_chat_template(files, stories):
    """The tokenizer comes from the file (same ids as the folder's tokenizer.json) with its chat template, and the
    story is the published one."""
    lm = load_model(str(files["stories", "Q8_0"][0]))
    text = "Once upon a time, there was a little girl named Lily."
    assert lm.tokenizer(text)["input_ids"] == stories.tokenizer(text)["input_ids"]
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert prompt.endswith("<|user|>\nhi\n<|assistant|>\n")
    ids = lm.tokenizer("Once upon a time")["input_ids"]
    story = lm.tokenizer.decode(engine_greedy(lm, ids, 12, CacheConfig()))
    assert story.startswith(", there was a little girl named Lily")
    assert lm.info.layer_kinds == ("full",) * 5 and lm.info.context_length == 512


def test_gemma2_gguf_keeps_its_sliding_window(files):
    lm = load_model(str(files["gemma2", "F32"][0]))
    assert lm.info.layer_kinds == ("sliding", "full") and lm.info.windows[0] == 8


def test_generate_says_the_weights_memory_before_loading(files, capsys):
    """``generate --model FILE.gguf``: the note with the memory on stderr, then the story. The Q8_0 blocks stay
    as the file stores them (engine.quant); its F32 tensors (stories260K's 172-wide rows, the norms) too."""
    import re

    from engine.tools.cli import main

    path = files["stories", "Q8_0"][0]
    assert main(["generate", "--model", str(path), "--prompt", "Once upon a time", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()
    note = next(line for line in out.err.splitlines() if "stories-Q8_0.gguf: Q8_0 weights" in line)
    where = "repacked" if kernel.packs(8) else "mapped"  # the integer road's layout on this CPU
    assert re.fullmatch(r"note: stories-Q8_0\.gguf: Q8_0 weights \(444\.0 KiB on disk, \d+\.\d\d bits per weight\) "
                        rf"stay as the file stores them, {where} from the file: \d+\.\d KiB of weights in memory "
                        r"\(int8 activations, [^)]+\)", note), note
    assert out.out.startswith(", there was a little girl")


def test_requantize_on_load_says_so(files):
    """--quantize int8 re-quantizes the dequantized weights with bitsandbytes; the memory is said first."""
    said = []
    lm = load_model(ModelSpec(source=str(files["qwen2", "Q8_0"][0]), quantization="int8"),
                    progress=lambda m, f: said.append(m))
    assert type(lm.model.model.layers[0].self_attn.q_proj).__name__ == "Linear8bitLt"
    note = next(m for m in said if m.startswith("qwen2-Q8_0.gguf: Q8_0 weights ("))  # (after the memory verdict)
    assert "are dequantized to float32, then quantized to 8-bit by bitsandbytes" in note
    assert len(engine_greedy(lm, PROMPT, 4, CacheConfig())) == 4


def test_header_facts(files):
    info = read_gguf(files["stories", "Q8_0"][0])
    assert (info.architecture, info.context_length, info.weights_type, info.quantized) == ("llama", 512, "Q8_0", True)
    assert info.n_params == 260_032  # stories260K's parameters, tied embedding once
    assert dict(info.type_counts) == {"Q8_0": 31, "F32": 16}  # the 172-wide down projections stay F32
    cfg = info.config()
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (5, 4, 8, 512)


# -- bad files ---------------------------------------------------------------------------------------------------
def _patched_type(src: Path, dst: Path, tensor: str, ggml_type: int) -> Path:
    data = bytearray(src.read_bytes())
    i = data.find(tensor.encode()) + len(tensor)
    dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<I", data, i + 4 + 8 * dims, ggml_type)
    dst.write_bytes(data)
    return dst


@pytest.fixture(scope="module")
def bad_files(files, tmp_path_factory):
    """{name: (path, the line's expected part)} — each made the way it happens to people."""
    d = tmp_path_factory.mktemp("bad")
    good = files["stories", "Q8_0"][0]
    data = good.read_bytes()
    (d / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])  # a download that stopped
    (d / "header-cut.gguf").write_bytes(data[:200])
    (d / "wrong-magic.gguf").write_bytes((ROOT / "resources/models/stories260K/model.safetensors").read_bytes()[:4096])
    _patched_type(good, d / "unknown-type.gguf", "token_embd.weight", 99)
    shutil.copy(good, d / "big-00001-of-00003.gguf")
    shutil.copy(good, d / "big-00003-of-00003.gguf")
    (d / "empty.gguf").write_bytes(b"")
    os.mkfifo(d / "pipe.gguf")
    (d / "folder.gguf").mkdir()
    os.symlink("loop.gguf", d / "loop.gguf")
    return {
        "truncated.gguf": "truncated.gguf is truncated: ",
        "header-cut.gguf": "header-cut.gguf is corrupt or truncated",
        "wrong-magic.gguf": "wrong-magic.gguf is not a GGUF file (a safetensors file",
        "unknown-type.gguf": "tensor 'token_embd.weight' has unknown GGML type 99",
        "big-00001-of-00003.gguf": "is one part of a model split in 3 files and 1 is missing (big-00002-of-00003.gguf)",
        "empty.gguf": "empty.gguf is empty (0 bytes)",
        "pipe.gguf": "pipe.gguf is a pipe (FIFO), not a GGUF file",
        "folder.gguf": "folder.gguf is a directory, not a GGUF file",
        "loop.gguf": "loop.gguf is a symbolic link loop",
    }, d


def _tree(d: Path) -> dict[str, tuple[int, float]]:
    return {p.name: (os.lstat(p).st_size, os.lstat(p).st_mtime) for p in d.iterdir()}


def test_every_bad_file_one_line_from_the_cli(bad_files, capsys):
    """``generate --model BAD`` for each: exit 2, one line naming the file on stderr, no traceback, nothing in the
    folder changed — and the FIFO never blocks (it is never opened)."""
    from engine.tools.cli import main

    expected, d = bad_files
    before = _tree(d)
    for name, part in expected.items():
        rc = main(["generate", "--model", str(d / name), "--prompt", "hi", "--max-new-tokens", "2"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and part in err, (name, err)
    assert _tree(d) == before


def test_all_parts_of_a_split_file_refused_with_the_merge(bad_files):
    _, d = bad_files
    shutil.copy(d / "big-00001-of-00003.gguf", d / "big-00002-of-00003.gguf")
    try:
        with pytest.raises(ModelFormatError, match=r"split in 3 files; transformers reads a single file: merge"):
            load_model(str(d / "big-00001-of-00003.gguf"))
    finally:
        (d / "big-00002-of-00003.gguf").unlink()


def test_unsupported_architecture_names_the_readable_ones(files, tmp_path):
    import gguf

    path = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv7")
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        load_model(str(path))
    line = str(e.value)
    assert line.startswith("rwkv.gguf: transformers cannot read architecture 'rwkv7' from GGUF; it reads ")
    assert all(a in line for a in ("gemma2", "llama", "qwen2", "qwen2moe", "phi3")) and "\n" not in line


def test_missing_file():
    with pytest.raises(ModelNotFoundError, match="model file not found"):
        load_model("/nonexistent/model.gguf")


def test_served_gguf_answers_with_its_chat_template(files):
    """``serve --model FILE.gguf``'s server: /v1/models names the file, a chat is rendered with the template the
    file carries (its prompt tokens are that template's), and the reply is the engine's greedy continuation."""
    import httpx

    from engine.server import KVServer, ServerOptions, ServerThread

    path = files["stories", "Q8_0"][0]
    lm = load_model(str(path))
    thread = ServerThread(KVServer(lm, CacheConfig(), ServerOptions(), source=str(path)))
    url = thread.start()
    try:
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["stories-Q8_0.gguf"]
        messages = [{"role": "user", "content": "Once upon a time"}]
        r = httpx.post(url + "/v1/chat/completions", json={"model": "stories-Q8_0.gguf", "messages": messages,
                                                           "max_tokens": 8, "temperature": 0}, timeout=120).json()
    finally:
        thread.stop()
    from engine.model.chat import render_chat

    prompt = render_chat(lm.tokenizer, messages)
    text = lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|user|>\nOnce upon a time\n<|assistant|>\n")  # the file's template
    assert lm.tokenizer.decode(prompt, skip_special_tokens=True).endswith("Once upon a time\n<|assistant|>\n")
    assert r["usage"]["prompt_tokens"] == len(prompt)
    want = engine_greedy(lm, prompt, 8, CacheConfig())
    assert r["choices"][0]["message"]["content"] == lm.tokenizer.decode(want, skip_special_tokens=True)
