"""A splice's searches read each start of a ~5,000-token prompt's ids as the shared head's text, decoded once, and
the start's tail (``engine.model.splice._starts``): that is every start's own decoded text, on a byte-level
vocabulary (Qwen2.5's) and on SentencePiece ones (a first token's space dropped alone, byte-fallback runs), heads
ending anywhere (inside a run of byte tokens, at a multi-byte character) — and where a tokenizer does not decode
piecewise at the head, each start is decoded whole."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from engine.model import splice

VOCAB = Path(__file__).resolve().parents[1] / "data" / "vocab"
TEXT = ("The fox ran 🦊 past the Ünïcödé sign, then   three spaces\tand a tab; 中文字符 too.\n" * 3
        + "def f(x):\n    return x ** 2  # ok")


@pytest.fixture(scope="module", params=["qwen2.5", "llama-spm", "phi-3"])
def tok(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vocab")
    if request.param == "qwen2.5":
        from tool_models import qwen_tokenizer

        return qwen_tokenizer(tmp)
    from transformers import AutoTokenizer

    gguf = tmp / f"ggml-vocab-{request.param}.gguf"
    with gzip.open(VOCAB / f"ggml-vocab-{request.param}.gguf.gz") as src, open(gguf, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return AutoTokenizer.from_pretrained(str(tmp), gguf_file=gguf.name)


def test_every_start_reads_as_its_own_decoded_text(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > 40
    for lo in (1, 5, len(ids) // 3, len(ids) // 2, len(ids) - 3):
        text_of = splice._starts(tok, ids, lo)
        for m in range(lo, len(ids) + 1):
            assert text_of(m) == splice._text(tok, ids[:m]), (lo, m)


def test_a_tokenizer_that_does_not_decode_piecewise_gets_whole_starts():
    class Joined:  # decodes with a separator between tokens: a head's text plus a tail's is not the whole's
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

        def get_vocab(self):
            return {}

    seq = [5, 6, 7, 8, 9]
    text_of = splice._starts(Joined(), seq, 2)
    assert [text_of(m) for m in range(2, 6)] == ["5 6", "5 6 7", "5 6 7 8", "5 6 7 8 9"]


def test_byte_tokens_are_the_vocabularys_byte_pieces_read_only_where_the_decoder_makes_bytes(tok, monkeypatch):
    """The ids held as bytes while streaming: a SentencePiece vocabulary's 256 ``<0x..>`` pieces (its decoder's
    ByteFallback turns them into bytes); none for a byte-level one (Qwen2.5's), known from its decoder without
    reading the whole vocabulary."""
    from engine.model import chat

    hexdigits = "0123456789ABCDEFabcdef"
    scan = {i: int(t[3:5], 16) for t, i in tok.get_vocab().items()
            if len(t) == 6 and t.startswith("<0x") and t[5] == ">" and all(c in hexdigits for c in t[3:5])}
    fallback = "ByteFallback" in tok.backend_tokenizer.decoder.__getstate__().decode()
    reads, real = [], type(tok).get_vocab
    monkeypatch.setattr(type(tok), "get_vocab", lambda self: reads.append(1) or real(self))
    chat._BYTE_TOKENS.pop(tok, None)
    assert chat.byte_tokens(tok) == scan and len(scan) == (256 if fallback else 0)
    assert bool(reads) == fallback
