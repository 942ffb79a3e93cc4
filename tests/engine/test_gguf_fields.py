"""A GGUF's transformers settings read from the header the engine parsed (``engine.model.gguf_fields``): the same
config as transformers' own ``GGUFReader`` pass, the same tokenizer, without that pass."""

import gzip
from pathlib import Path

import gguf
import pytest

from engine.model import gguf_fields, gguf_load
from engine.model.gguf_file import read_gguf

VOCAB = Path(__file__).resolve().parents[1] / "data" / "vocab"


@pytest.fixture(scope="module", params=["phi-3", "llama-spm"])
def vocab(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("fields") / f"ggml-vocab-{request.param}.gguf"
    with gzip.open(VOCAB / f"ggml-vocab-{request.param}.gguf.gz") as src, open(path, "wb") as dst:
        dst.write(src.read())
    return path


def _counting(monkeypatch) -> list:
    calls, real = [], gguf.GGUFReader

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)
    monkeypatch.setattr(gguf, "GGUFReader", counted)
    return calls


def test_settings_and_tokenizer_are_transformers_own_without_its_reader(vocab, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    info = read_gguf(vocab)
    assert gguf_fields.covers(info)
    calls = _counting(monkeypatch)
    from transformers.integrations import gguf as package
    from transformers.integrations.gguf import reader

    reads, real = [], reader.read_gguf_metadata
    counted = lambda *a: reads.append(tuple(map(str, a))) or real(*a)  # noqa: E731
    monkeypatch.setattr(reader, "read_gguf_metadata", counted)
    monkeypatch.setattr(package, "read_gguf_metadata", counted)
    with gguf_fields.from_header(info):
        config, tok = gguf_load._config(vocab), gguf_load._tokenizer(vocab)
    assert calls == []  # neither read the header with GGUFReader again
    assert len(reads) == len(set(reads))  # each way of reading it once (the vocabulary twice without ``from_header``)
    assert reader.read_gguf_metadata is counted and package.read_gguf_metadata is counted  # put back
    real_config = AutoConfig.from_pretrained(str(vocab.parent), gguf_file=str(vocab))
    real_tok = AutoTokenizer.from_pretrained(str(vocab.parent), gguf_file=str(vocab))
    assert len(calls) >= 1  # the real pass ran through the counter: the check above can fail
    assert config.to_dict() == real_config.to_dict()
    text = "Once upon a time, ünïcode and  spaces\n<|user|>"
    assert tok(text)["input_ids"] == real_tok(text)["input_ids"] and len(tok) == len(real_tok)
    assert gguf.GGUFReader.__name__ == "counted"  # put back: the reader from before the load


@pytest.mark.parametrize("arrays", [(), ("tokenizer.ggml.tokens",), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")])
def test_the_metadata_read_from_the_header_is_transformers_readers(vocab, arrays):
    """transformers' ``read_gguf_metadata`` answered from the parsed header: the same keys, values and types
    (the vocabulary's strings, its scores and types as lists, the arrays not asked for as counts), the same
    tensor names, without its reader (``real`` is None: a call of it would fail)."""
    from transformers.integrations.gguf import reader

    info = read_gguf(vocab)
    ours, theirs = gguf_fields._from_info(info, None)(str(vocab), arrays), reader.read_gguf_metadata(str(vocab), arrays)
    assert ours == theirs
    assert [type(v) for v in ours[0].values()] == [type(v) for v in theirs[0].values()]
    assert all(isinstance(ours[0][a], list) and len(ours[0][a]) > 1000 for a in arrays if a in ours[0])


def test_a_vocabulary_kept_as_a_count_gives_its_size(vocab):
    """Without ``{arch}.vocab_size`` the legacy reader counts the vocabulary: the count is there; with it, the
    vocabulary is not read at all."""
    import dataclasses

    info = read_gguf(vocab)
    arch = info.architecture
    sized = dict(info.metadata, **{f"{arch}.vocab_size": 32_000})
    assert "tokenizer.ggml.tokens" not in gguf_fields.HeaderReader(dataclasses.replace(info, metadata=sized)).fields
    unsized = {k: v for k, v in info.metadata.items() if k != f"{arch}.vocab_size"}
    reader = gguf_fields.HeaderReader(dataclasses.replace(info, metadata=unsized))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == info.metadata["tokenizer.ggml.tokens"]["count"] > 30_000
    if f"{arch}.context_length" in info.metadata:
        from transformers.modeling_gguf_pytorch_utils import read_field

        assert read_field(reader, f"{arch}.context_length") == [info.metadata[f"{arch}.context_length"]]


def test_a_byte_level_file_without_endoftext_loads_with_its_own_vocabulary(tmp_path):
    """transformers' byte-level builder adds GPT-2's ``<|endoftext|>`` past a vocabulary without it (Llama-3's):
    the file loads, the tokenizer is as long as the embedding, and typing the text gives no id past it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from engine.config import ModelSpec
    from engine.model.loader import load_model
    from gguf_make import write_gguf

    alphabet = list(bytes_to_unicode().values())  # 256 symbols
    tokens = alphabet + ["Ġt", "he", "<|begin_of_text|>", "<|end_of_text|>"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=False)).eval()
    path = write_gguf(model, "llama", None, tmp_path / "bpe.gguf", bpe=(tokens, ["Ġ t", "h e"], 2))
    lm = load_model(ModelSpec(source=str(path), device="cpu"))
    assert len(lm.tokenizer) == len(tokens) == lm.model.get_input_embeddings().num_embeddings
    ids = lm.tokenizer("the <|endoftext|> <|end_of_text|>")["input_ids"]
    assert max(ids) < len(tokens) and len(tokens) - 1 in ids  # the file's control token whole, the other as bytes


@pytest.mark.parametrize("case", ["long-strings", "length-past-the-end", "cut-in-a-length"])
def test_the_header_walks_a_vocabulary_in_chunks_and_bounds_each_length(tmp_path, stories_path, case):
    """Strings longer than the reader's 1 MiB chunk, a length past the end of the file, a file cut inside a
    length: the same count as each string read alone, or one line naming the file."""
    import struct

    import gguf_raw as raw
    from engine.errors import ModelFormatError
    from gguf_make import write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    base = write_gguf(model, "llama", stories_path / "tokenizer.model", tmp_path / "base.gguf")
    g = raw.read(base)
    if case == "long-strings":  # 3 MiB strings among short ones: each crosses the chunk
        items = [b"a" * (3 << 20) if i % 100 == 7 else f"t{i}".encode() for i in range(512)]
        g.set_raw("tokenizer.ggml.merges", raw.ARR, raw.strings(items))
        info = read_gguf(g.write(tmp_path / "long.gguf"))
        assert {k: v for k, v in info.metadata["tokenizer.ggml.merges"].items() if k != "at"} == \
            {"count": 512, "type": "STRING"}
        assert info.tensors and info.metadata["tokenizer.ggml.tokens"]["count"] == 512
        from transformers.integrations.gguf import reader  # the long strings decoded from where the header found them

        arrays = ("tokenizer.ggml.merges",)
        ours = gguf_fields._from_info(info, None)(str(info.path), arrays)
        assert ours == reader.read_gguf_metadata(str(info.path), arrays) and len(ours[0][arrays[0]][7]) == 3 << 20
        return
    blob = raw.strings(f"t{i}" for i in range(5000))
    if case == "length-past-the-end":
        at = 12 + sum(8 + len(f"t{i}") for i in range(4000))  # the 4,001st string's length
        blob = blob[:at] + struct.pack("<Q", 1 << 40) + blob[at + 8:]
        path = g.set_raw("tokenizer.ggml.merges", raw.ARR, blob).write(tmp_path / "bad.gguf")
    else:
        path = g.set_raw("tokenizer.ggml.merges", raw.ARR, blob).write(tmp_path / "cut.gguf")
        data = path.read_bytes()
        path.write_bytes(data[:data.index(b"t4321") - 4])
    with pytest.raises(ModelFormatError) as e:
        read_gguf(path)
    assert path.name in str(e.value) and ("corrupt" in str(e.value) or "truncated" in str(e.value))


@pytest.mark.parametrize("strings", [["a", "", "ü" * 128, "x" * 256, "日本"], ["a\0b", "c", ""], []])
def test_the_vocabulary_is_decoded_at_once_as_string_by_string(strings):
    """The strings of a metadata array decoded in one pass are those decoded one by one: an empty one, a length
    whose low byte is zero (256), a NUL inside a string (decoded one by one then)."""
    import array
    import mmap
    import struct

    blob = b"pad" + b"".join(struct.pack("<Q", len(s.encode())) + s.encode() for s in strings)
    mm = mmap.mmap(-1, len(blob))
    mm.write(blob)
    v = {"count": len(strings), "type": "STRING", "at": 3}
    assert gguf_fields._long(mm, v, True) == strings and gguf_fields._long(mm, v, False) == len(strings)
    starts = array.array("q", [3 + sum(8 + len(t.encode()) for t in strings[:i]) for i in range(len(strings))])
    assert gguf_fields._long(mm, v, True, (starts, len(blob))) == strings  # where a header's walk found them
    with pytest.raises(ValueError):  # a length past the end
        gguf_fields._long(mm, dict(v, count=len(strings) + 1), True)


def test_the_headers_walk_serves_the_table_and_the_reader_until_the_file_changes(tmp_path, stories_path):
    """A vocabulary's strings are walked once, by the header: the tensor table and the metadata reader take where
    they start and end from that walk (the same entries and strings as their own walks), until the file is written
    again (then none is taken: an offset of the old file never reads the new one's bytes); an end past the file is
    not taken either."""
    import mmap

    import gguf_raw as raw
    from engine.model import gguf_file
    from engine.quant.gguf_table import Table
    from gguf_make import write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    g = raw.read(write_gguf(model, "llama", stories_path / "tokenizer.model", tmp_path / "base.gguf"))
    merges = [f"t{i} u{i}" for i in range(5000)]
    path = g.set_raw("tokenizer.ggml.merges", raw.ARR, raw.strings(merges)).write(tmp_path / "m.gguf")
    info = read_gguf(path)
    v = info.metadata["tokenizer.ggml.merges"]
    walked = gguf_file.string_starts(info)
    assert set(walked) == {v["at"], info.metadata["tokenizer.ggml.tokens"]["at"]}
    assert len(walked[v["at"]][0]) == 5000 and walked[v["at"]][1] > walked[v["at"]][0][-1] > v["at"]
    ends = {at: end for at, (_, end) in walked.items()}
    assert Table(path, ends).entries == Table(path).entries == Table(path, {a: 1 << 40 for a in ends}).entries
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert gguf_fields._long(mm, v, True, walked[v["at"]]) == gguf_fields._long(mm, v, True) == merges
    g.set_raw("tokenizer.ggml.merges", raw.ARR, raw.strings(merges[:4000])).write(path)  # written again
    assert gguf_file.string_starts(info) == {}
    assert gguf_fields._from_info(read_gguf(path), None)(str(path), ("tokenizer.ggml.merges",))[0][
        "tokenizer.ggml.merges"] == merges[:4000]


def test_the_headers_string_walk_across_its_reads_and_in_cut_files(tmp_path, stories_path):
    """The header's walk of a long string array (read a MiB at a time) finds every string's start, strings of any
    length crossing the reads; a file cut anywhere in the array, or a length past the file, is one line, never a
    read past the end."""
    import gguf_raw as raw
    from engine.errors import ModelFormatError
    from engine.model import gguf_file
    from gguf_make import write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    g = raw.read(write_gguf(model, "llama", stories_path / "tokenizer.model", tmp_path / "base.gguf"))
    merges = [("m" * (i % 61)) + f" {i}" if i % 5000 else "w" * (i % 7 * 300_000) for i in range(120_000)]
    path = g.set_raw("tokenizer.ggml.merges", raw.ARR, raw.strings(merges)).write(tmp_path / "m.gguf")
    info = read_gguf(path)
    at = info.metadata["tokenizer.ggml.merges"]["at"]
    lengths = [len(m.encode()) for m in merges]
    want = [at]
    for n in lengths[:-1]:
        want.append(want[-1] + 8 + n)
    starts, end = gguf_file.string_starts(info)[at]
    assert list(starts) == want and end == want[-1] + 8 + lengths[-1]
    data = path.read_bytes()
    for cut in (at + 3, want[7] + 8 + 2, want[5000] + 9, want[60_000] + 4, end - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError) as e:
            read_gguf(bad)
        assert "truncated" in str(e.value) and "\n" not in str(e.value)
    bad = bytearray(data)
    bad[want[70_000]:want[70_000] + 8] = (len(data)).to_bytes(8, "little")  # a length past the file
    (tmp_path / "long.gguf").write_bytes(bad)
    with pytest.raises(ModelFormatError, match=f"a string of {len(data):,} in a {len(data):,}-byte file"):
        read_gguf(tmp_path / "long.gguf")


def _qwen_vocab(path: Path, user_defined: bool, outside: bool) -> Path:
    """A vocabulary-only GGUF of Qwen2.5's byte-level vocabulary and merges (``data/qwen25_tokenizer.json.xz``), its
    added tokens control (3), or the non-special ones user-defined (4) as llama.cpp's converter marks them;
    ``outside``: one added token spelled outside the byte alphabet ("中文", which transformers respells)."""
    import json
    import lzma

    doc = json.loads(lzma.decompress((Path(__file__).parent / "data" / "qwen25_tokenizer.json.xz").read_bytes()))
    tokens = sorted(doc["model"]["vocab"], key=doc["model"]["vocab"].get)
    types = [1] * len(tokens)
    for added in doc["added_tokens"]:
        tokens.append("中文" if outside and added["content"] == "<|file_sep|>" else added["content"])
        types.append(3 if added["special"] or not user_defined else 4)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in doc["model"]["merges"]])
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("user_defined,outside", [(False, False), (True, False), (False, True)])
def test_a_byte_level_vocabulary_builds_the_same_tokenizer_on_its_short_roads(tmp_path, monkeypatch, user_defined,
                                                                                outside):
    """Qwen2.5's vocabulary built with the byte-level builder's one-dict vocabulary and without the whole-vocabulary
    lookup for a file with no user-defined token: the same tokenizer (its serialization, its ids for a text) as
    transformers' own builders give under the same header; each short road taken only where it applies."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    path = _qwen_vocab(tmp_path / "qwen.gguf", user_defined, outside)
    info = read_gguf(path)
    respelled, lookups, real_get_vocab = [], [], TokenizersBackend.get_vocab
    monkeypatch.setattr(TokenizersBackend, "get_vocab", lambda self: lookups.append(1) or real_get_vocab(self))
    byte_level, specials = gguf_fields._byte_level, gguf_fields._specials

    def build(short_roads: bool):
        lookups.clear()
        counted = lambda b, real: byte_level(b, lambda d: respelled.append(1) or real(d))  # noqa: E731
        monkeypatch.setattr(gguf_fields, "_byte_level", counted if short_roads else (lambda b, real: real))
        monkeypatch.setattr(gguf_fields, "_specials", specials if short_roads else (lambda real: real))
        with gguf_fields.from_header(info):
            tok = gguf_load._tokenizer(path)
        return tok, len(lookups)

    (fast, fast_lookups), (slow, slow_lookups) = build(True), build(False)
    assert fast.backend_tokenizer.to_str() == slow.backend_tokenizer.to_str()
    text = "Hello  wörld <tool_call>{\"a\": 1}</tool_call><|im_end|> 中文 12345"
    assert fast(text)["input_ids"] == slow(text)["input_ids"] and len(fast) == len(slow)
    assert fast.convert_ids_to_tokens(151657) == "<tool_call>" and 151657 in fast(text)["input_ids"]
    assert respelled == ([1] if outside else [])  # the builder's own respelling only for the token outside
    assert fast_lookups == slow_lookups - (0 if user_defined else 1)  # the lookup skipped only without type 4


@pytest.mark.parametrize("scored", [True, False])
def test_a_sentencepiece_vocabularys_merges_are_transformers_own(vocab, scored):
    """The merges a vocabulary without any implies (``spm_merges``): transformers' list, pair for pair and in its
    order — by the file's scores, best first (``get_merges``), and by the ids where no scores are given."""
    from transformers.tokenization_utils_base import generate_merges

    from engine.model import spm_merges

    info = read_gguf(vocab)
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores")
    metadata, _ = gguf_fields._from_info(info, None)(str(vocab), arrays)
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    by = dict(zip(tokens, scores)) if scored else None
    ours, theirs = spm_merges.generate_merges(ids, by), generate_merges(ids, by)
    assert len(theirs) > 10_000 and ours == theirs
    assert spm_merges.generate_merges({"a": 0, "b": 1, "ab": 2}, {"ab": 1.0, "a": 0.0, "b": 0.0}) == [("a", "b")]
    assert spm_merges.generate_merges({}, None) == []


def test_a_files_long_tokens_cost_no_more_than_their_lengths(monkeypatch):
    """A vocabulary's one 8M-character token is cut only where a token that long and one as long as its rest can
    meet (none here: no pair, in well under a second, where cutting it everywhere copies 10^13 characters); tokens
    made to make the cuts quadratic are refused in one line past ``MAX_CUT_CHARACTERS``."""
    from transformers.tokenization_utils_base import generate_merges

    from engine.model import spm_merges

    small = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc", "ca", "cab"])}
    scores = {t: -float(i) for t, i in small.items()}
    long = dict(small, **{"ab" * 4_000_000 + "z": len(small)})
    merges = spm_merges.generate_merges(long, dict(scores, **{"ab" * 4_000_000 + "z": -99.0}))
    assert merges == generate_merges(small, scores) and ("a", "b") in merges
    monkeypatch.setattr(spm_merges, "MAX_CUT_CHARACTERS", 10_000)
    stairs = {"a" * n: n for n in range(1, 300)}
    with pytest.raises(ValueError, match="too long to derive merges"):
        spm_merges.generate_merges(stairs, {t: 0.0 for t in stairs})
