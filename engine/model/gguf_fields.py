"""transformers' GGUF settings read from the header this engine already parsed, not by ``gguf.GGUFReader`` again.

Why: transformers 5.24 reads a llama-family file's settings with its legacy ``load_gguf_checkpoint``, which builds a
``GGUFReader`` (a numpy object per array element of the whole header), and reads them again for the tokenizer's
config: a Llama-3 vocabulary (128,256 tokens, 280,147 merges) took 16.6 s for ``AutoConfig`` and 14.1 s for
``AutoTokenizer`` here, where llama.cpp opens the file in under a second. ``engine.model.gguf_file`` has the header
already (scalars, strings, short arrays; ~0.8 s for that vocabulary), so while transformers reads the settings its
``GGUFReader`` is this module's ``HeaderReader``: the same ``fields`` / ``tensors`` for everything but the long
arrays (tokens, merges, scores), which no setting is made of. The tokenizer still reads its vocabulary with
transformers' own fast reader. Where the header lacks what the legacy reader would take from a long array (the
vocabulary's size where ``{arch}.vocab_size`` is missing), or anything here raises, transformers' reader runs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import struct
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np

from engine.model import spm_merges
from engine.model.gguf_file import GgufInfo, string_starts

# GGUFValueType: the widest of each kind (``_gguf_parse_value`` reads any integer, float or bool type alike)
_BOOL, _INT, _FLOAT, _STRING, _ARRAY = 7, 11, 12, 8, 9
_TOKENS = "tokenizer.ggml.tokens"
_lock = threading.Lock()  # one swap of gguf.GGUFReader at a time (loads run one at a time; this makes it sure)


def _scalar(v: Any) -> tuple[int, np.ndarray] | None:
    if isinstance(v, bool):
        return _BOOL, np.array([v], dtype=np.bool_)
    if isinstance(v, int):
        return _INT, np.array([v], dtype=object)  # object: a uint64 above int64's range stays exact
    if isinstance(v, float):
        return _FLOAT, np.array([v], dtype=np.float64)
    if isinstance(v, str):
        return _STRING, np.frombuffer(v.encode("utf-8"), dtype=np.uint8)
    return None


def _field(name: str, v: Any) -> SimpleNamespace | None:
    """A ``gguf.ReaderField`` as transformers reads it (``parts[i] for i in data``, parsed by ``types``); None for
    what the header kept only as a count (a long array) or nested arrays."""
    one = _scalar(v)
    if one is not None:
        return SimpleNamespace(name=name, parts=[one[1]], data=[0], types=[one[0]])
    if not isinstance(v, list):
        return None
    items = [_scalar(x) for x in v]
    if any(i is None or i[0] == _STRING for i in items) or len({i[0] for i in items}) > 1:
        return None
    kind = items[0][0] if items else _INT
    return SimpleNamespace(name=name, parts=[i[1] for i in items], data=list(range(len(items))), types=[_ARRAY, kind])


class _Same:
    """``parts`` of a counted array: every index the same empty string (only the count is read of it)."""

    def __init__(self, part: np.ndarray) -> None:
        self.part = part

    def __getitem__(self, i: int) -> np.ndarray:
        return self.part


def _counted(name: str, v: dict) -> SimpleNamespace | None:
    """The vocabulary, kept by the header as a count: n empty strings (the legacy reader takes a missing
    ``{arch}.vocab_size`` from its length; ~0.1 s for 150,000 where reading the tokens took seconds)."""
    if name != _TOKENS or v.get("type") != "STRING" or not isinstance(v.get("count"), int):
        return None
    return SimpleNamespace(name=name, parts=_Same(np.zeros(0, dtype=np.uint8)), data=range(v["count"]),
                           types=[_ARRAY, _STRING])


class HeaderReader:
    """What ``load_gguf_checkpoint(..., return_tensors=False)`` reads of a ``GGUFReader``, from ``info``."""

    def __init__(self, info: GgufInfo) -> None:
        counted = f"{info.architecture}.vocab_size" not in info.metadata  # else no setting needs the vocabulary
        self.fields = {k: f for k, v in info.metadata.items()
                       if (f := (_counted(k, v) if counted else None) if isinstance(v, dict) else _field(k, v))
                       is not None}
        self.tensors = [SimpleNamespace(name=t.name) for t in info.tensors]


def covers(info: GgufInfo) -> bool:
    """Can the settings come from the header? (The legacy reader counts the vocabulary for a missing
    ``{arch}.vocab_size``: the header has the count, where the vocabulary is a plain list of strings.)"""
    tokens = info.metadata.get(_TOKENS)
    return f"{info.architecture}.vocab_size" in info.metadata or (
        isinstance(tokens, dict) and tokens.get("type") == "STRING")


_NUMPY = {"UINT8": "<u1", "INT8": "<i1", "UINT16": "<u2", "INT16": "<i2", "UINT32": "<u4", "INT32": "<i4",
          "FLOAT32": "<f4", "BOOL": "?", "UINT64": "<u8", "INT64": "<i8", "FLOAT64": "<f8"}


def _from_info(info: GgufInfo, real):
    """transformers' ``read_gguf_metadata`` answered for ``info``'s file from the header the engine parsed, its
    long arrays read from where the header found them (``"at"``): the numbers by numpy, the strings asked for
    (``string_arrays``: the vocabulary, the merges) decoded from the mapped file in one walk, the others counted.
    Why: its reader decodes each string through a numpy slice (~1.8 us: 0.73 s for Llama-3's 408,451) and walks
    every string array again for each of the three callers that read the metadata (the config, the tokenizer's
    class, the tokenizer). Any other file, or a header with arrays of arrays: transformers' reader."""
    import mmap

    answerable = all(not isinstance(v, dict) or "at" in v for v in info.metadata.values())

    def read(path, string_arrays=()):
        if not answerable or os.path.realpath(path) != os.path.realpath(info.path):
            return real(path, string_arrays)
        walked = string_starts(info)  # the header's walk: where each string starts, not walked again
        with open(info.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            metadata = {k: _long(mm, v, k in string_arrays, walked.get(v.get("at"))) if isinstance(v, dict) else v
                        for k, v in info.metadata.items()}
        return metadata, tuple(t.name for t in info.tensors)
    return read


def _long(mm, v: dict, keep: bool, walked: tuple | None = None):
    """A long array as transformers' reader gives it: a list of numbers; a list of strings (``keep``) or their
    count. Each length bounded by the mapping (a file cut inside one: ValueError, as its reader). ``walked``: the
    strings' starts and end as the header's walk found them in this file (``gguf_file.string_starts``)."""
    n, at = v["count"], v["at"]
    if v["type"] != "STRING":
        width = np.dtype(_NUMPY[v["type"]]).itemsize
        if at + n * width > len(mm):
            raise ValueError("a GGUF metadata array runs past the end of the file")
        return np.frombuffer(mm[at:at + n * width], dtype=_NUMPY[v["type"]]).tolist()
    if not keep:
        return n
    if walked is not None and len(walked[0]) == n and walked[1] <= len(mm):
        return _decoded(mm, at, walked[1], walked[0])
    starts, size, unpack, first = [], len(mm), struct.Struct("<Q").unpack_from, at
    for _ in range(n):  # the lengths walked (each bounded by the mapping), then every string decoded at once
        if at + 8 > size:
            raise ValueError("a GGUF metadata string's length runs past the end of the file")
        (length,) = unpack(mm, at)
        if length > size - at - 8:
            raise ValueError("a GGUF metadata string runs past the end of the file")
        starts.append(at)
        at += 8 + length
    return _decoded(mm, first, at, starts)


def _decoded(mm, first: int, end: int, starts) -> list[str]:
    """The strings whose 8-byte lengths lie at ``starts`` (bytes ``first``..``end`` of the file), decoded as
    transformers' reader decodes each (UTF-8, strict): each length's first byte made a NUL, its other seven dropped,
    the whole decoded once and split at the NULs (0.7 -> ~0.1 us a string); strings holding a NUL themselves are
    decoded one by one."""
    if not len(starts):
        return []
    raw = np.frombuffer(mm[first:end], dtype=np.uint8).copy()  # [bytes]
    at = np.asarray(starts, dtype=np.int64) - first  # [n] where each length lies (a list or an array('q'))
    content = np.ones(raw.shape[0], dtype=bool)
    content[(at[:, None] + np.arange(8)).ravel()] = False  # [n * 8] the lengths' bytes
    if np.count_nonzero(raw[content] == 0):  # a NUL inside a string: the split would cut it
        return [str(mm[a + 8:b], "utf-8") for a, b in zip(starts, [*starts[1:], end])]
    content[at] = True
    raw[at] = 0
    return raw[content].tobytes().decode("utf-8").split("\0")[1:]


def _read_once(real):
    """transformers' ``read_gguf_metadata`` answering a second call for the same file and arrays from the first
    (its tokenizer reads the vocabulary twice: ~0.6 s each for Llama-3's); each caller gets its own lists."""
    seen: dict[tuple, tuple[dict, tuple]] = {}

    def read(path, string_arrays=()):
        key = (os.path.realpath(path), tuple(sorted(string_arrays)))
        if key not in seen:
            seen[key] = real(path, string_arrays)
        metadata, names = seen[key]
        return {k: list(v) if isinstance(v, list) else v for k, v in metadata.items()}, names
    return read


@contextlib.contextmanager
def from_header(info: GgufInfo):
    """While this runs, transformers' GGUF settings for ``info.path`` come from ``info`` (module doc), its fast
    reader reads the file once, and a byte-level vocabulary gets no token the file lacks (``_no_defaults``) and is
    built on the short roads where they give the same tokenizer (``_byte_level``, ``_specials``, a SentencePiece
    vocabulary's merges by ``spm_merges``), the garbage collector paused (``_no_collection``); any other file is
    read by ``gguf.GGUFReader`` as before."""
    import gguf
    from transformers.integrations import gguf as package
    from transformers.integrations.gguf import gguf_tokenizer_mapping as builders
    from transformers.integrations.gguf import reader as fast

    real, real_fast, real_map = gguf.GGUFReader, fast.read_gguf_metadata, fast._mapped
    path, whole, once = os.path.realpath(info.path), covers(info), _read_once(_from_info(info, real_fast))

    def mapped(p):  # a plain array over the same mapping: numpy's memmap slices through Python code
        return real_map(p).view(np.ndarray)  # ~2.5 us a string of 408,451 (Llama-3's): 1.04 -> 0.43 s

    def reader(p, *args, **kwargs):
        if whole and not args and not kwargs and os.path.realpath(p) == path:
            return HeaderReader(info)
        return real(p, *args, **kwargs)

    with _lock, _no_collection():
        gguf.GGUFReader, fast.read_gguf_metadata, package.read_gguf_metadata, fast._mapped = reader, once, once, mapped
        merges, builders.generate_merges = builders.generate_merges, spm_merges.generate_merges
        gpt2, builders.GPT2Tokenizer = builders.GPT2Tokenizer, _no_defaults(builders.GPT2Tokenizer)
        specials, byte_level = builders.add_gguf_special_tokens, builders.GGUF_TOKENIZER_TYPES.get("gpt2")
        builders.add_gguf_special_tokens = _specials(specials)
        if byte_level is not None:
            builders.GGUF_TOKENIZER_TYPES["gpt2"] = _byte_level(builders, byte_level)
        try:
            yield
        finally:
            gguf.GGUFReader, fast.read_gguf_metadata, package.read_gguf_metadata = real, real_fast, real_fast
            fast._mapped, builders.GPT2Tokenizer, builders.generate_merges = real_map, gpt2, merges
            builders.add_gguf_special_tokens = specials
            if byte_level is not None:
                builders.GGUF_TOKENIZER_TYPES["gpt2"] = byte_level


@contextlib.contextmanager
def _no_collection():
    """Python's cyclic garbage collector paused while a vocabulary is built: the build makes ~0.7M strings and
    tuples (Llama-3's), none in a cycle, and each of the collections their count sets off walks every one of them
    again (Llama-3's load 0.465 -> 0.405 s). Reference counting still frees everything as before; what was paused
    before stays paused."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _no_defaults(gpt2):
    """The byte-level vocabulary's builder (GPT-2's tokenizer) without GPT-2's special tokens: its default
    ``<|endoftext|>`` was added past a vocabulary without it (Llama-3's: id 128,256 of 128,256 embedding rows;
    DeepSeek's: 102,402 of 102,400 + 2). The file's own BOS / EOS / UNK are set from its ids after the build, as
    before; tokenizers of the files that have the token (GPT-2, Qwen2, StarCoder, Falcon) come out the same."""
    return functools.partial(gpt2, unk_token=None, bos_token=None, eos_token=None)


def _byte_level(builders, real):
    """transformers' byte-level builder, its vocabulary made in one ``dict(zip(...))`` when every token is already
    spelled in the byte alphabet (one set of all their characters and one ``dict``: 53 ms for Llama-3's 128,256
    tokens, where its per-token respelling check took 155); a vocabulary with any other character: transformers'
    own (it respells those tokens)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = frozenset(bytes_to_unicode().values())

    def build(tokenizer_dict):
        tokens = tokenizer_dict["tokens"]
        if not set("".join(tokens)) <= alphabet:
            return real(tokenizer_dict)
        return builders.GPT2Tokenizer(vocab=dict(zip(tokens, range(len(tokens)))),
                                      merges=builders.get_merges(tokenizer_dict))
    return build


def _specials(real):
    """transformers' ``add_gguf_special_tokens``, which reads the whole vocabulary (``get_vocab``: 0.1 s for
    Llama-3's) only to look up the tokens the file marks user-defined (type 4): a file with none gets an empty one
    for that call, the same tokens added."""
    def add(tokenizer, tokenizer_dict):
        if 4 in (tokenizer_dict.get("token_type") or ()):
            return real(tokenizer, tokenizer_dict)
        tokenizer.get_vocab = dict  # this call's lookup only: every one is for a type-4 token
        try:
            return real(tokenizer, tokenizer_dict)
        finally:
            del tokenizer.get_vocab
    return add
