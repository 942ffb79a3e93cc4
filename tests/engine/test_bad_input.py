"""Every bad input: a typed error from the API, and from the CLI a non-zero exit with one line, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from engine import errors
from engine.tools.cli import main as cli_main
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.model.loader import load_model


def _copy(stories_path, dst, skip=()):
    dst.mkdir()
    for f in stories_path.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture()
def bad_models(tmp_path, stories_path):
    m = {}
    m["missing"] = tmp_path / "does-not-exist"
    m["no_config"] = tmp_path / "empty"
    m["no_config"].mkdir()
    m["corrupt"] = _copy(stories_path, tmp_path / "corrupt")
    (m["corrupt"] / "model.safetensors").write_bytes(b"\x07" * 4096)
    m["truncated"] = _copy(stories_path, tmp_path / "truncated")
    data = (stories_path / "model.safetensors").read_bytes()
    (m["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    m["pickle"] = _copy(stories_path, tmp_path / "pickle", skip=("model.safetensors",))
    from safetensors.torch import load_file

    torch.save(load_file(stories_path / "model.safetensors"), m["pickle"] / "pytorch_model.bin")
    m["remote"] = _copy(stories_path, tmp_path / "remote")
    cfg = json.loads((stories_path / "config.json").read_text())
    cfg.update(model_type="my_custom_llm", auto_map={"AutoModelForCausalLM": "modeling_custom.MyModel"})
    (m["remote"] / "config.json").write_text(json.dumps(cfg))
    m["unsupported"] = _copy(stories_path, tmp_path / "unsupported")
    (m["unsupported"] / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    m["unknown_type"] = _copy(stories_path, tmp_path / "unknown_type")
    (m["unknown_type"] / "config.json").write_text(json.dumps({"model_type": "totally_new_arch"}))
    m["no_tokenizer"] = _copy(stories_path, tmp_path / "no_tokenizer",
                              skip=("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    return m


API_CASES = [
    ("missing", errors.ModelNotFoundError, "not found"),
    ("no_config", errors.ModelFormatError, "no config.json"),
    ("corrupt", errors.ModelFormatError, "corrupt"),
    ("truncated", errors.ModelFormatError, "truncated"),
    ("pickle", errors.UnsafeModelError, "pickle"),
    ("remote", errors.UnsafeModelError, "remote code"),
    ("unsupported", errors.UnsupportedModelError, "not a text-generation"),
    ("unknown_type", errors.UnsupportedModelError, "unsupported model type"),
    ("no_tokenizer", errors.ModelFormatError, "tokenizer"),
]


@pytest.mark.parametrize("case,exc,words", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_raises_typed_error(bad_models, case, exc, words):
    with pytest.raises(exc) as info:
        load_model(ModelSpec(source=str(bad_models[case]), allow_download=False))
    msg = str(info.value)
    assert words in msg and "\n" not in msg


@pytest.mark.parametrize("case,exc,words", API_CASES, ids=[c[0] for c in API_CASES])
def test_cli_exits_nonzero_with_one_line(bad_models, capsys, case, exc, words):
    rc = cli_main(["generate", "--model", str(bad_models[case]), "--prompt", "hi", "--offline"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and words in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_pickle_loads_when_allowed(bad_models, stories):
    lm = load_model(ModelSpec(source=str(bad_models["pickle"]), allow_pickle=True))
    ids = stories.tokenizer("Once upon a time")["input_ids"]
    x = torch.tensor([ids])
    assert torch.equal(lm.model(x).logits, stories.model(x).logits)


@pytest.mark.parametrize("argv,words", [
    (["--page-size", "0"], "page size: 0 is outside 1..256"),
    (["--page-size", "300"], "page size: 300 is outside 1..256"),
    (["--cache", "sometimes"], "invalid choice: 'sometimes'"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--temperature", "nan"], "temperature: nan is not a finite number"),
    (["--top-p", "nan"], "top-p: nan is not a finite number"),
    (["--min-p", "inf"], "min-p: inf is not a finite number"),
    (["--repetition-penalty=-inf"], "repetition penalty: -inf is not a finite number"),
])
def test_cli_bad_settings(stories_path, capsys, argv, words):
    with pytest.raises(SystemExit) if "invalid choice" in words else _nullcontext() as ex:
        rc = cli_main(["generate", "--model", str(stories_path), "--prompt", "hi", *argv])
    if ex is not None and hasattr(ex, "value"):
        rc = ex.value.code
    err = capsys.readouterr().err
    assert rc == 2
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def test_api_config_validation():
    with pytest.raises(ValueError, match="page size"):
        CacheConfig(page_size=0)
    with pytest.raises(ValueError, match="cache mode"):
        CacheConfig(mode="turbo")
    with pytest.raises(ValueError, match="max new tokens"):
        SamplingConfig(max_new_tokens=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name,label", [("temperature", "temperature"), ("top_p", "top-p"), ("min_p", "min-p"),
                                        ("repetition_penalty", "repetition penalty")])
def test_sampling_refuses_non_finite_values(name, label, value):
    """NaN passes every ``<`` range check; inf is no better (inf temperature is uniform noise)."""
    with pytest.raises(ValueError) as info:
        SamplingConfig(**{name: value})
    assert str(info.value) == f"{label}: {value} is not a finite number"


@pytest.mark.parametrize("kwargs,words", [
    ({"max_new_tokens": 2.5}, "max new tokens: 2.5 is not an integer"),
    ({"max_new_tokens": True}, "max new tokens: True is not an integer"),
    ({"max_new_tokens": "8"}, "max new tokens: '8' is not an integer"),
    ({"top_k": 1.5}, "top-k: 1.5 is not an integer"),
    ({"top_k": False}, "top-k: False is not an integer"),
    ({"seed": 1.5}, "seed: 1.5 is not an integer"),
    ({"temperature": "0.5"}, "temperature: '0.5' is not a number"),
    ({"top_p": None}, "top-p: None is not a number"),
    ({"repetition_penalty": True}, "repetition penalty: True is not a number"),
])
def test_sampling_refuses_wrong_types(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingConfig(**kwargs)
    assert str(info.value) == words


def test_sampling_accepts_ints_for_floats():
    s = SamplingConfig(temperature=1, top_p=1, min_p=0, repetition_penalty=2, top_k=5, seed=3, max_new_tokens=4)
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (1, 1, 5, 4) and not s.greedy


def test_api_context_overflow_is_never_silent(stories):
    from engine.core.session import ChatSession

    s = ChatSession(stories, CacheConfig())
    long_prompt = "Once upon a time " * 200
    with pytest.raises(errors.ContextOverflowError, match="the prompt has"):
        s.start_completion(long_prompt, SamplingConfig(max_new_tokens=1))
    # the session is still usable
    s.start_completion("Once", SamplingConfig(max_new_tokens=3))
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "max_tokens"


def test_cli_subprocess_missing_model_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(tmp_path / "nope"),
                        "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("error: model folder not found")
    assert "Traceback" not in p.stderr and p.stdout == ""


# -- --messages FILE and --prompt text ------------------------------------------------------------------------
def _cli_generate_error(stories_path, capsys, *argv) -> str:
    rc = cli_main(["generate", "--model", str(stories_path), "--max-new-tokens", "4", *argv])
    cap = capsys.readouterr()
    assert rc == 2, cap.err
    assert cap.out == "" and cap.err.startswith("error: ") and cap.err.count("\n") == 1
    assert "internal" not in cap.err and "Traceback" not in cap.err
    return cap.err


def _deep(path):
    path.write_text("[" * 100_000 + "]" * 100_000)


def _surrogate(path):
    path.write_text('[{"role": "user", "content": "hi \\ud800 there"}]')  # valid JSON, invalid Unicode


def _not_utf8(path):
    path.write_bytes(b'[{"role": "user", "content": "caf\xe9"}]')  # Latin-1


MESSAGE_FILES = {
    "deep": (_deep, "is nested too deeply"),
    "surrogate": (_surrogate, r"messages[0] content: invalid character '\ud800' at position 3"),
    "not_utf8": (_not_utf8, "is not UTF-8 text (byte 0xe9 at position 33): save it as UTF-8"),
    "directory": (lambda path: path.mkdir(), "is a directory"),
}


@pytest.mark.parametrize("case", sorted(MESSAGE_FILES))
def test_cli_bad_messages_file(stories_path, tmp_path, capsys, case):
    path = tmp_path / "chat.json"
    make, words = MESSAGE_FILES[case]
    make(path)
    err = _cli_generate_error(stories_path, capsys, "--messages", str(path))
    assert words in err


def test_cli_unreadable_messages_file(stories_path, tmp_path, capsys, monkeypatch):
    path = tmp_path / "chat.json"
    path.write_text('[{"role": "user", "content": "hi"}]')
    path.chmod(0)
    if os.geteuid() == 0:  # root reads anything: make os.open (engine.inputs) answer as for anyone else
        real_open = os.open

        def no_permission(file, *a, **kw):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *a, **kw)

        monkeypatch.setattr(os, "open", no_permission)
    err = _cli_generate_error(stories_path, capsys, "--messages", str(path))
    assert f"cannot read messages file {path}: Permission denied" in err


def test_api_refuses_lone_surrogates(stories):
    from engine.model.chat import validate_messages
    from engine.core.session import ChatSession

    with pytest.raises(ValueError, match=r"messages\[1\] content: invalid character '\\udcff' at position 0"):
        validate_messages([{"role": "user", "content": "ok"}, {"role": "user", "content": "\udcff"}])
    s = ChatSession(stories, CacheConfig())
    with pytest.raises(ValueError, match=r"prompt: invalid character '\\ud800' at position 5"):
        s.start_completion("Once \ud800", SamplingConfig(max_new_tokens=2))


def test_cli_prompt_with_lone_surrogate(stories_path, capsys):
    """Bytes that are not UTF-8 in argv arrive as lone surrogates (surrogateescape)."""
    err = _cli_generate_error(stories_path, capsys, "--prompt", "caf\udce9")
    assert r"prompt: invalid character '\udce9' at position 3" in err


def test_cli_subprocess_prompt_not_utf8(stories_path):
    p = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(stories_path),
                        "--prompt", b"caf\xe9", "--max-new-tokens", "2"], capture_output=True, timeout=120)
    assert p.returncode == 2 and p.stdout == b""
    assert p.stderr.decode().startswith("error: prompt: invalid character") and p.stderr.count(b"\n") == 1


# -- bench/quality --json PATH is checked before any work ----------------------------------------------------------
def _read_only_target(tmp_path):
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        return ro / "out.json"
    if not os.path.isdir("/sys"):
        pytest.skip("root writes anywhere on this system: no read-only place to try")
    return "/sys/kvscope-out.json"  # sysfs refuses new files even to root


@pytest.mark.parametrize("command", ["bench", "quality"])
@pytest.mark.parametrize("case,words", [
    ("directory", "is a directory: give a file name"),
    ("missing_parent", "does not exist"),
    ("read_only", "cannot write there (Permission denied)"),
])
def test_cli_unwritable_json_fails_before_any_work(stories_path, tmp_path, capsys, monkeypatch, command, case, words):
    import engine.tools.bench
    import engine.model.loader
    import engine.tools.quality

    calls = []
    monkeypatch.setattr(engine.model.loader, "load_model", lambda *a, **k: calls.append("load_model"))
    monkeypatch.setattr(engine.tools.bench, "run_bench", lambda a: calls.append("run_bench") or 0)
    monkeypatch.setattr(engine.tools.quality, "run_quality", lambda a: calls.append("run_quality") or 0)
    target = {"directory": tmp_path, "missing_parent": tmp_path / "no" / "such" / "out.json",
              "read_only": _read_only_target(tmp_path)}[case]
    rc = cli_main([command, "--model", str(stories_path), "--json", str(target)])
    err = capsys.readouterr().err
    assert rc == 2 and calls == []
    assert words in err
    assert err.startswith(f"error: --json {target}") and err.count("\n") == 1


def test_cli_json_check_leaves_no_file_and_keeps_an_existing_one(tmp_path, capsys, monkeypatch):
    import engine.tools.bench

    seen = []
    monkeypatch.setattr(engine.tools.bench, "run_bench", lambda a: seen.append(os.path.exists(a.json_file)) or 0)
    new = tmp_path / "new.json"
    assert cli_main(["bench", "--shape", "tiny-llama", "--json", str(new)]) == 0
    assert seen == [False]  # the check made no empty file that a failed run would leave behind
    old = tmp_path / "old.json"
    old.write_text('{"rows": []}')
    assert cli_main(["bench", "--shape", "tiny-llama", "--json", str(old)]) == 0
    assert old.read_text() == '{"rows": []}'


def test_reply_longer_than_the_context_stops_there_and_says_so(stories):
    """A reply whose max new tokens pass the context is not refused: it gets the tokens that fit, stop reason
    context_full, and a note saying how much room there was and what to do."""
    from engine.core.session import ChatSession

    s = ChatSession(stories, CacheConfig())
    s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=600, ignore_eos=True))
    prompt = len(s.seq)
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "context_full"
    assert len(s.seq) == 512 and len(s.generated_ids) == 512 - prompt
    assert any(f"room for {512 - prompt} new tokens" in w and "start a new chat" in w for w in r.warnings)
    s.start_completion("Once", SamplingConfig(max_new_tokens=3))  # the session goes on
    while not (r := s.step()).done:
        pass
    assert r.stop_reason == "max_tokens" and not r.warnings


def test_cli_reply_past_the_context_is_reported(stories_path, capsys):
    rc = cli_main(["generate", "--model", str(stories_path), "--prompt", "Once upon a time", "--max-new-tokens",
                   "600", "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["stop_reason"] == "context_full" and len(out["token_ids"]) == 512 - out["prompt_tokens"]
    assert any("the reply stops when the context is full" in w for w in out["warnings"])
