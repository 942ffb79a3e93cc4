"""Inputs that used to fail deep inside (or not at all) are refused in one line, exit 2 (#20 item 15).

A zero head count raised ZeroDivisionError in the model's constructor; a garbage ``pytorch_model.bin``
with ``--allow-pickle`` an internal UnpicklingError / IndexError; ``--messages /dev/zero`` read until
MemoryError; ``bench --contexts ''`` and ``--repeats 0`` wrote empty rows with exit 0; ``--new-tokens 0``
failed after loading. The bench refusals name a model folder that does not exist: a refusal about the
flag (not "model folder not found") shows the flag was checked before any loading.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile

import pytest

from engine import errors
from engine.tools.cli import main as cli_main
from engine.config import ModelSpec
from engine.model.loader import load_model
from engine.inputs import DEFAULT_LIMIT as MAX_MESSAGES_BYTES


def _copy(stories_path, dst, **config):
    dst.mkdir()
    for f in stories_path.iterdir():
        shutil.copy(f, dst / f.name)
        (dst / f.name).chmod(0o644)  # the shared copy is read-only
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def _one_line_error(capsys, argv) -> str:
    rc = cli_main(argv)
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    assert out.err.startswith("error: ") and out.err.count("\n") == 1 and "internal" not in out.err, out.err
    return out.err


CONFIG_CASES = {
    "kv_heads_0": ({"num_key_value_heads": 0}, "config.json has num_key_value_heads 0: it must be at least 1"),
    "q_heads_negative": ({"num_attention_heads": -8}, "config.json has num_attention_heads -8: it must be at least 1"),
    "hidden_0": ({"hidden_size": 0}, "config.json has hidden_size 0: it must be at least 1"),
    "layers_0": ({"num_hidden_layers": 0}, "config.json has num_hidden_layers 0: it must be at least 1"),
    "kv_not_dividing": ({"num_key_value_heads": 3}, "config.json has num_attention_heads 8, not a multiple of num_key_value_heads 3"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_sizes_are_refused_before_building(tmp_path, stories_path, capsys, case):
    fields, words = CONFIG_CASES[case]
    folder = _copy(stories_path, tmp_path / case, **fields)
    with pytest.raises(errors.ModelFormatError) as info:
        load_model(ModelSpec(source=str(folder), device="cpu", allow_download=False))
    assert str(info.value).startswith(f"{case}: {words}")
    err = _one_line_error(capsys, ["generate", "--model", str(folder), "--prompt", "hi", "--offline"])
    assert words in err


def _zip_without_pickle(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/readme.txt", "not a checkpoint")


PICKLE_CASES = {
    "random_bytes": (lambda p: p.write_bytes(bytes(range(256)) * 4), "is not a PyTorch checkpoint"),
    "legacy_magic_then_garbage": (lambda p: p.write_bytes(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
                                                          b"garbage"), "is corrupt: torch cannot read it"),
    "zip_magic_then_garbage": (lambda p: p.write_bytes(b"PK\x03\x04garbage"), "is corrupt: torch cannot read it"),
    "zip_without_pickle": (_zip_without_pickle, "is corrupt: torch cannot read it"),
    "not_a_state_dict": (lambda p: __import__("torch").save([1, 2, 3], p), "is not a state dict"),
}


@pytest.mark.parametrize("case", sorted(PICKLE_CASES))
def test_garbage_pickle_weights_are_one_line(tmp_path, stories_path, capsys, case):
    folder = _copy(stories_path, tmp_path / case)
    (folder / "model.safetensors").unlink()
    write, words = PICKLE_CASES[case]
    write(folder / "pytorch_model.bin")
    err = _one_line_error(capsys, ["generate", "--model", str(folder), "--prompt", "hi", "--offline",
                                   "--allow-pickle"])
    assert err.startswith(f"error: pytorch_model.bin {words}"), err


def test_messages_from_an_endless_file_are_refused_unread(stories_path):
    """``/dev/zero`` never ends: it is a device, refused before a byte is read and before the model loads
    (engine.inputs; tests/engine/test_cli_inputs.py has the other kinds of file)."""
    p = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(stories_path), "--messages",
                        "/dev/zero"], capture_output=True, text=True, timeout=600)  # a hang guard only
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "error: messages file /dev/zero is a device, not a file: give a JSON list of {role, content}\n"


def test_messages_file_at_the_limit_is_still_read(tmp_path, capsys, stories_path):
    """Just under the limit the file is parsed (here: refused as JSON that is not a list), not called too big."""
    f = tmp_path / "big.json"
    f.write_text(json.dumps({"pad": "x" * (MAX_MESSAGES_BYTES - 20)}))
    assert f.stat().st_size <= MAX_MESSAGES_BYTES
    err = _one_line_error(capsys, ["generate", "--model", str(stories_path), "--messages", str(f)])
    assert "larger than" not in err


BENCH_CASES = {
    "no_contexts": (["--contexts", ""], "--contexts '' gives no prompt length and no other measurement"),
    "repeats_0": (["--repeats", "0"], "--repeats 0: it must be at least 1"),
    "new_tokens_0": (["--new-tokens", "0"], "--new-tokens 0: it must be at least 1"),
    "new_tokens_negative": (["--new-tokens", "-3"], "--new-tokens -3: it must be at least 1"),
    "context_0": (["--contexts", "0,32"], "--contexts '0,32': every prompt length must be at least 1"),
    "context_word": (["--contexts", "32,many"], "--contexts '32,many': a comma list of prompt lengths"),
    "no_modes": (["--modes", ","], "--modes ',' names no mode"),
    "concurrency_no_contexts": (["--contexts", "", "--concurrency", "2", "--long", "8"],
                                "--concurrency needs prompt lengths in --contexts"),
}


@pytest.mark.parametrize("case", sorted(BENCH_CASES))
def test_bench_flags_are_refused_before_loading(tmp_path, capsys, case):
    flags, words = BENCH_CASES[case]
    out = tmp_path / "b.json"
    err = _one_line_error(capsys, ["bench", "--model", str(tmp_path / "no-such-model"), "--json", str(out), *flags])
    assert err == f"error: {words}" + err[len("error: ") + len(words):]
    assert "not found" not in err and not out.exists()


def test_bench_without_contexts_still_runs_a_scenario(tmp_path, stories_path):
    """``--contexts ''`` is fine when another measurement is asked for: ``--long`` here, rows of kind long."""
    out = tmp_path / "b.json"
    assert cli_main(["bench", "--model", str(stories_path), "--contexts", "", "--modes", "paged", "--long", "8",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["context"], r["new_tokens"]) for r in rows] == [("paged", 16, 8)]


def _shard(folder, metadata):
    """model.safetensors as a one-shard checkpoint with an index (``metadata`` None: the index has none)."""
    from engine.model.model_files import read_header

    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    names = read_header(folder / "model-00001-of-00001.safetensors")[0]
    index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in names}}
    if metadata is not None:
        index["metadata"] = metadata
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_an_index_without_metadata_is_one_line(tmp_path, stories_path, capsys):
    """transformers reads the index's "metadata": without it the CLI said "internal KeyError: 'metadata'"."""
    bad = _copy(stories_path, tmp_path / "no-metadata")
    _shard(bad, None)
    err = _one_line_error(capsys, ["generate", "--model", str(bad), "--prompt", "hi", "--offline"])
    assert err == "error: model.safetensors.index.json is corrupt: it has no metadata object (re-download or " \
                  "re-export the model)\n"
    good = _copy(stories_path, tmp_path / "sharded")
    _shard(good, {"total_size": 0})
    lm = load_model(ModelSpec(source=str(good), device="cpu", allow_download=False))
    assert lm.info.num_layers == 5  # a sharded folder with its index loads
