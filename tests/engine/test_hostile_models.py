"""Hostile model files end in one line, within bounded memory and time (``hostile_models`` makes them).

Each case is a file a user could download or keep in a folder the Models dialog scans: a 128-byte GGUF declaring
10^9 split parts, 10^6 layers over the tensors of 5, a context length that is a string, a million-token vocabulary
over 512 embedding rows, chat templates that loop 10^10 times or build 2 GB strings, a config.json whose sizes are
not numbers. Before, these took up to 5.5 GB and 150 s, or ended in "internal ZeroDivisionError", or hid every
model in the dialog. Now: ``generate`` exits 2 with one line naming the file and the value, in seconds and with the
process's peak memory not raised by more than ``_MB``; the catalog lists every good model beside every bad one.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest

import hostile_models
from hostile_models import TEMPLATES

from engine.model import catalog, template_guard
from engine.model.catalog import scan

_MB = 500  # the bound above a clean load
_S = 10


@pytest.fixture(scope="module")
def cases(tmp_path_factory, stories_path):
    d = tmp_path_factory.mktemp("hostile")
    return hostile_models.make(d, stories_path), hostile_models.messages_file(d), d


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", [
    "split-count-1e9", "block-count-1e6", "context-length-string", "head-count-kv-0", "vocab-size-1e9", "hidden-1e6",
    "head-count-1e6", "ffn-wrong", "eps-string", "rope-nan", "vocab-1e6", "vocab-3", "embd-4rows", "t5-no-tensors",
    "no-architecture", "part-missing", *TEMPLATES, "config-abc", "config-1e400", "config-list", "folder-template"])
def test_one_line_exit_2_bounded(cases, name, capsys):
    """``generate --model FILE`` (a chat for the template cases): exit 2, one line on stderr that names the file
    and the value, nothing "internal", no report that is not printed; seconds, and no more than ``_MB`` of peak."""
    from engine.tools.cli import main

    found, chat, _ = cases
    case = found[name]
    how = ["--messages", str(chat)] if case.chat else ["--prompt", "hi"]
    before, t0 = _peak_mb(), time.perf_counter()
    rc = main(["generate", "--model", str(case.path), *how, "--max-new-tokens", "2"])
    seconds, grew = time.perf_counter() - t0, _peak_mb() - before
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert case.expect in err and case.path.name in err, err
    assert "internal" not in err and "report" not in err, err
    assert seconds < _S and grew < _MB, (name, seconds, grew)


@pytest.mark.parametrize("name", ["split-count-1e9", "block-count-1e6", "vocab-1e6", "t5-no-tensors", "config-list"])
def test_a_bad_header_is_said_before_torch_is_imported(cases, name, tmp_path):
    """A file's header checks run before the command imports torch and transformers (seconds of a busy machine's
    start): with a torch that cannot be imported on the path, the file's own line is what the command says."""
    import subprocess
    import sys

    poisoned = tmp_path / "torch"
    poisoned.mkdir()
    (poisoned / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    found, _, _ = cases
    case = found[name]
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[2]}"}
    p = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(case.path), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert (p.returncode, p.stderr.count("\n")) == (2, 1), p.stderr
    assert case.expect in p.stderr and "torch was imported" not in p.stderr, p.stderr


def test_catalog_lists_the_good_beside_every_bad(cases, monkeypatch):
    """The Models dialog's scan over a folder holding all the cases and a good model: every GGUF and folder listed,
    the good ones openable, each bad one with its own reason — none of them stops the scan."""
    _, _, d = cases
    found = {m.name: m for m in scan([d], env={"HOME": str(d / "home")}).models}
    assert found["base.gguf"].problem == "" and found["base.gguf"].context_length == 512
    assert found["base.gguf"].config["num_hidden_layers"] == 5
    expect = {"context-length-string.gguf": "llama.context_length is a string ('abc')",
              "block-count-1e6.gguf": "block_count is 1,000,000",
              "split-count-1e9.gguf": "split.count is 1,000,000,000",
              "vocab-1e6.gguf": "1,000,000 tokens",
              "head-count-kv-0.gguf": "head_count_kv is 0",
              "config-abc": "max_position_embeddings is a string ('abc')",
              "config-1e400": "max_position_embeddings is inf",
              "config-list": "max_position_embeddings is a list"}
    for name, part in expect.items():
        assert part in found[name].problem and found[name].config == {}, (name, found[name].problem)
    assert found["template-nested-loops.gguf"].problem == ""  # a template is only rendered when it is loaded


def test_a_capped_walk_says_where_it_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "MAX_ENTRIES", 50)
    many = tmp_path / "many"
    many.mkdir()
    for i in range(60):
        (many / f"f{i:03d}.txt").write_text("")
    result = scan([many], env={"HOME": str(tmp_path / "home")})
    assert result.models == ()
    assert result.notes == (f"Stopped looking in {many} after 50 files and folders (at {many}): models further in "
                            "are not listed; add their folder itself",)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_template_bombs_stop_within_bounds(name):
    from transformers.utils.chat_template_utils import render_jinja_template

    template_guard.install()
    t0 = time.perf_counter()
    with pytest.raises(template_guard.TemplateLimitError):
        render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=TEMPLATES[name])
    assert time.perf_counter() - t0 < template_guard.SECONDS + 1.5


def test_a_loop_without_hooks_is_stopped_by_the_clock():
    """Two loops over the message's characters call nothing the environment sees: the render thread is stopped
    by the exception raised into it, and the next render runs as usual."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template_guard.install()
    text = "{% for a in messages[0].content %}{% for b in messages[0].content %}{% endfor %}{% endfor %}ok"
    t0 = time.perf_counter()
    with pytest.raises(template_guard.TemplateLimitError, match="longer than 2 s"):
        render_jinja_template([[{"role": "user", "content": "x" * 200_000}]], chat_template=text)
    assert time.perf_counter() - t0 < template_guard.SECONDS + 1.5
    assert render_jinja_template([[{"role": "user", "content": "xy"}]], chat_template=text)[0] == ["ok"]


def test_real_templates_render_as_transformers_renders_them():
    """The bounded environment changes no output: the templates of Llama 3.1, Qwen2.5, Hermes 3 (tools), Mistral
    and gpt-oss give the same text as transformers' own environment, tools and a reply included."""
    from transformers.utils import chat_template_utils as ctu

    data = Path(__file__).parent / "data" / "chat_templates"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Sunny, 21 °C."}, {"role": "user", "content": "And tomorrow?"}]
    template_guard.install()
    for path in sorted(data.glob("*.jinja")):
        text = path.read_text()
        extra = dict(date_string="26 Jul 2024", bos_token="<s>", eos_token="</s>")
        ours = ctu.render_jinja_template([chat], tools=tools, chat_template=text, add_generation_prompt=True,
                                         **extra)[0][0]
        theirs = ctu._cached_compile_jinja_template(text).render(
            messages=ctu._alias_reasoning_fields(json.loads(json.dumps(chat))), tools=tools, documents=None,
            add_generation_prompt=True, **extra)
        assert ours == theirs and "get_weather" in ours, path.name


def test_a_request_past_the_bounds_is_one_line(cases, capsys, tmp_path):
    """A template that passes the trial render at load but builds 10^9 characters for one message: that chat is
    refused in one line (exit 2), naming the bound."""
    from engine.tools.cli import main

    import gguf_raw

    _, _, d = cases
    text = "{% for m in messages %}{% if 'boom' in m.content %}{{ 'x' * 10**9 }}{% endif %}{{ m.content }}{% endfor %}"
    path = gguf_raw.read(d / "base.gguf").set("tokenizer.chat_template", gguf_raw.STR, text).write(tmp_path / "b.gguf")
    chat = tmp_path / "boom.json"
    chat.write_text(json.dumps([{"role": "user", "content": "boom"}]))
    rc = main(["generate", "--model", str(path), "--messages", str(chat), "--max-new-tokens", "2"])
    err = capsys.readouterr().err.splitlines()  # the load's note, then the refusal
    assert rc == 2 and err[-1].startswith("error: ") and "Traceback" not in "".join(err), err
    assert "the chat template of b.gguf went past a render's bounds: it repeats a value 1,000,000,000 times" in err[-1]
