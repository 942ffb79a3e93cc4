"""Broken model folders: weights that do not cover the model, malformed safetensors, odd folder layouts.

Each case copies stories260K and corrupts one thing. The API raises ``ModelFormatError`` with a one-line
reason; the CLI exits 2 with that line on stderr (never exit 0 with a half-random model, never "internal").
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from engine import errors
from engine.tools.cli import main as cli_main
from engine.config import ModelSpec
from engine.model.loader import load_model


def _copy(stories_path, dst):
    dst.mkdir()
    for f in stories_path.iterdir():
        shutil.copy(f, dst / f.name)
        (dst / f.name).chmod(0o644)  # the shared copy is read-only
    return dst


def _rewrite_header(path, edit):
    """Replace the safetensors header with ``edit(header)`` (any JSON value), keeping the data bytes."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = edit(json.loads(data[8:8 + n]))
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _edit(name, **fields):
    def edit(h):
        h[name].update(fields)
        return h
    return edit


def _offsets(name, move):
    """New data_offsets for tensor ``name``: ``move(start, end)``."""
    def edit(h):
        h[name]["data_offsets"] = move(*h[name]["data_offsets"])
        return h
    return edit


def _entry(name, value):
    def edit(h):
        h[name] = value
        return h
    return edit


def _resave(folder, edit):
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})


NORM = "model.norm.weight"  # F32 [64]: 256 bytes, the last tensor in the file
EMBED = "model.embed_tokens.weight"  # F32 [512, 64], the first

HEADER_CASES = {
    "header_list": (lambda h: list(h), "header is a list, not a JSON object"),
    "header_string": (lambda h: "model", "header is a string, not a JSON object"),
    "header_number": (lambda h: 42, "header is a number, not a JSON object"),
    "metadata_list": (_entry("__metadata__", ["pt"]), "__metadata__ is not an object of strings"),
    "entry_not_object": (_entry(NORM, [0, 256]), f"entry of tensor {NORM!r} is not an object"),
    "unknown_dtype": (_edit(NORM, dtype="Q7"), "unknown dtype 'Q7'"),
    "offsets_one": (_edit(NORM, data_offsets=[0]), "invalid data_offsets [0]"),
    "offsets_negative": (_edit(NORM, data_offsets=[-256, 0]), "invalid data_offsets [-256, 0]"),
    "offsets_strings": (_edit(NORM, data_offsets=["0", "256"]), "invalid data_offsets ['0', '256']"),
    "offsets_reversed": (_offsets(NORM, lambda s, e: [e, s]), "the end before the start"),
    "offsets_beyond": (_offsets(NORM, lambda s, e: [s + 4096, e + 4096]), "is truncated: "),
    "offsets_size": (_edit(NORM, shape=[65]), "shape [65] of F32 needs 260"),
    # one embedding row more or less: the next tensor's bytes are shared, or some bytes belong to none
    "offsets_overlap": (_edit(EMBED, shape=[513, 64], data_offsets=[0, 131328]), "overlap (bytes 131072..131328)"),
    "offsets_gap": (_edit(EMBED, shape=[511, 64], data_offsets=[0, 130816]),
                    "256 unused bytes before tensor 'model.layers.0.input_layernorm.weight'"),
    "shape_string": (_edit(NORM, shape="64"), "invalid shape '64'"),
    "shape_negative": (_edit(NORM, shape=[-64]), "invalid shape [-64]"),
    "shape_float": (_edit(NORM, shape=[64.0]), "invalid shape [64.0]"),
}


def _header_case(tmp_path, stories_path, case):
    folder = _copy(stories_path, tmp_path / case)
    _rewrite_header(folder / "model.safetensors", HEADER_CASES[case][0])
    return folder


def _load(folder, **kw):
    return load_model(ModelSpec(source=str(folder), allow_download=False, device="cpu", **kw))


def _cli_error(folder, capsys, *extra) -> str:
    rc = cli_main(["generate", "--model", str(folder), "--prompt", "hi", "--offline", "--max-new-tokens", "4",
                   "--device", "cpu", *extra])
    cap = capsys.readouterr()
    assert rc == 2, cap.err
    err = _without_notes(cap.err)  # the memory verdict said before the weights load is a note, not the error
    assert cap.out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert "internal" not in err and "Traceback" not in err
    return err


def _without_notes(err: str) -> str:
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("note: "))


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_malformed_safetensors_header(tmp_path, stories_path, capsys, case):
    folder = _header_case(tmp_path, stories_path, case)
    with pytest.raises(errors.ModelFormatError) as info:
        _load(folder)
    msg = str(info.value)
    assert "model.safetensors" in msg and HEADER_CASES[case][1] in msg and "\n" not in msg
    assert HEADER_CASES[case][1] in _cli_error(folder, capsys)


def test_trailing_bytes_after_the_data(tmp_path, stories_path, capsys):
    folder = _copy(stories_path, tmp_path / "trailing")
    with open(folder / "model.safetensors", "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(errors.ModelFormatError, match="64 bytes after the last tensor"):
        _load(folder)
    assert "64 bytes after the last tensor" in _cli_error(folder, capsys)


# -- folder layouts -------------------------------------------------------------------------------------------
def _dangling_weights(folder):
    (folder / "model.safetensors").unlink()
    os.symlink(folder / "gone.safetensors", folder / "model.safetensors")


def _replace_with_dir(name):
    def make(folder):
        (folder / name).unlink()
        (folder / name).mkdir()
    return make


def _tokenizer_beyond_vocab(folder):
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 512, "content": "<extra>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tok))


LAYOUT_CASES = {
    "dangling_symlink": (_dangling_weights, "model.safetensors is a broken link"),
    "weights_dir": (_replace_with_dir("model.safetensors"), "model.safetensors is a directory"),
    "config_dir": (_replace_with_dir("config.json"), "config.json is a directory"),
    "tokenizer_dir": (_replace_with_dir("tokenizer.json"), "tokenizer.json is a directory"),
    "tokenizer_beyond_vocab": (_tokenizer_beyond_vocab, "token ids up to 512 but the model has 512 embedding rows"),
}


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_bad_folder_layout(tmp_path, stories_path, capsys, case):
    folder = _copy(stories_path, tmp_path / case)
    make, words = LAYOUT_CASES[case]
    make(folder)
    with pytest.raises(errors.ModelFormatError) as info:
        _load(folder)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert words in _cli_error(folder, capsys)


# -- weights that do not cover the model ------------------------------------------------------------------------
def _drop_layer(sd):
    # a middle layer: without the last one the layer count itself is refused first (test_weight_index.py)
    return {k: v for k, v in sd.items() if not k.startswith("model.layers.2.")}


def _wrong_shape(sd):
    return {**sd, "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100)}


def _extra_key(sd):
    return {**sd, "model.layers.9.self_attn.q_proj.weight": torch.zeros(8, 8)}


COVER_CASES = {
    "missing_layer": (_drop_layer, ["9 weights missing", "model.layers.2.input_layernorm.weight", "and 6 more"]),
    "all_renamed": (lambda sd: {"foo." + k: v for k, v in sd.items()},
                    ["47 weights missing", "47 unexpected", "foo.model.embed_tokens.weight", "none of the"]),
    "wrong_shape": (_wrong_shape, ["model.layers.0.mlp.down_proj.weight", "[64, 100]", "[64, 172]"]),
    "extra_key": (_extra_key, ["1 unexpected", "model.layers.9.self_attn.q_proj.weight"]),
}


@pytest.mark.parametrize("quant", ["none", "nf4"])
@pytest.mark.parametrize("case", sorted(COVER_CASES))
def test_weights_must_cover_the_model(tmp_path, stories_path, capsys, case, quant):
    folder = _copy(stories_path, tmp_path / case)
    edit, words = COVER_CASES[case]
    _resave(folder, edit)
    with pytest.raises(errors.ModelFormatError) as info:
        _load(folder, quantization=quant)
    msg = str(info.value)
    assert "\n" not in msg and "lm_head" not in msg and "inv_freq" not in msg
    for w in words:
        assert w in msg
    err = _cli_error(folder, capsys, "--quantize", quant)
    assert all(w in err for w in words)


def test_cli_subprocess_nf4_missing_weights_is_one_line(tmp_path, stories_path):
    """In a fresh process bitsandbytes is imported by the load (its CPU backend warns at import)."""
    folder = _copy(stories_path, tmp_path / "missing")
    _resave(folder, _drop_layer)
    p = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(folder), "--prompt", "hi",
                        "--quantize", "nf4", "--device", "cpu", "--offline"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == ""
    err = _without_notes(p.stderr)
    assert err.startswith("error: ") and err.count("\n") == 1, p.stderr
    assert "9 weights missing" in err


def test_tied_head_and_stale_buffers_are_not_reported(tmp_path, stories_path, stories):
    """A file that also stores the tied lm_head and an old persistent rotary inv_freq still loads."""
    folder = _copy(stories_path, tmp_path / "tied")

    def edit(sd):
        return {**sd, "lm_head.weight": sd[EMBED].clone(),
                "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}

    _resave(folder, edit)
    lm = _load(folder)
    x = torch.tensor([stories.tokenizer("Once upon a time")["input_ids"]])
    assert torch.equal(lm.model(x).logits, stories.model(x).logits)


def test_a_gguf_tokenizers_ids_are_checked_by_its_token_count_and_added_tokens(stories_path):
    """A GGUF-built tokenizer's ids are its token array's positions: the rows check takes the file's token count and
    the added tokens' ids (not the whole vocabulary listed), and refuses an added token past the rows as a folder's."""
    from transformers import AutoTokenizer

    from engine.model.model_files import check_tokenizer_fits

    tok = AutoTokenizer.from_pretrained(str(stories_path))
    check_tokenizer_fits("m.gguf", tok, 512, dense=512)
    with pytest.raises(errors.ModelFormatError, match="token ids up to 512 but the model has 512 embedding rows"):
        check_tokenizer_fits("m.gguf", tok, 512, dense=513)
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})  # id 512, past the 512 rows
    with pytest.raises(errors.ModelFormatError, match="m.gguf: the tokenizer has token ids up to 512 but"):
        check_tokenizer_fits("m.gguf", tok, 512, dense=512)
