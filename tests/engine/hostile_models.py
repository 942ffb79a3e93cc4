"""Hostile model files, each made the way a user could meet it (a download, a file in a folder the Models dialog
scans), for ``test_hostile_models.py`` and ``measure_hostile_models.py``.

``make(folder, stories_path)`` writes every case and returns ``{name: Case}``: the file to open, how to open it
(``--prompt`` or ``--messages``: a chat template is rendered only for a chat), and the part of the one line it must
end in. The GGUF cases start from stories260K written as GGUF (``gguf_make``) and edit its header with
``gguf_raw``; the folder cases from a copy of stories260K's folder.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf_raw as raw
from gguf_raw import ARR, F32, STR, U32, U64

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}hi"
BIG_STRING = "{{ 'x' * 2000000000 }}"
BIG_RANGE = "{% for i in range(10**9) %}{% endfor %}"
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
WIDE = "{{ 'x'.ljust(2000000000) }}"
WIDE_FILTER = "{{ 'x' | center(2000000000) }}"
POWER = "{{ 10 ** 10 ** 9 }}"
RECURSION = "{% macro m(n) %}{{ m(n) }}{{ m(n) }}{% endmacro %}{{ m(1) }}"
DEEP_REPLACE = ("{% set ns = namespace(s='a' * 1000) %}{% for i in range(8) %}{% set ns.s = ns.s | replace('a', ns.s) %}"
                "{% endfor %}{{ ns.s | length }}")
TEMPLATES = {"template-nested-loops": NESTED_LOOPS, "template-big-string": BIG_STRING, "template-range-1e9": BIG_RANGE,
             "template-doubling": DOUBLING, "template-ljust": WIDE, "template-center": WIDE_FILTER,
             "template-power": POWER, "template-recursion": RECURSION, "template-replace": DEEP_REPLACE}


@dataclass(frozen=True)
class Case:
    path: Path
    expect: str  # a part of the one line
    chat: bool = False  # open with --messages (the chat template renders) rather than --prompt


def _stories_gguf(folder: Path, stories_path: Path) -> Path:
    import torch
    from gguf_make import write_gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    return write_gguf(model, "llama", stories_path / "tokenizer.model", folder / "base.gguf", "F32")


def _gguf_cases(d: Path, base: raw.RawGguf) -> dict[str, Case]:
    def edit(name: str, expect: str, chat: bool = False, **sets) -> None:
        g = raw.read(d / "base.gguf")
        for key, (vtype, v) in sets.items():
            g.set(key.replace("__", "."), vtype, v)
        cases[name] = Case(g.write(d / f"{name}.gguf"), expect, chat)

    cases: dict[str, Case] = {}
    tiny = raw.RawGguf().set("general.architecture", STR, "llama").set("split.count", U32, 10**9)
    cases["split-count-1e9"] = Case(tiny.write(d / "split-count-1e9.gguf", pad_data=False),
                                    "split.count is 1,000,000,000")
    edit("block-count-1e6", "llama.block_count is 1,000,000 but the file holds the tensors of 5 layers",
         llama__block_count=(U32, 10**6))
    edit("context-length-string", "llama.context_length is a string ('abc'), not a whole number",
         llama__context_length=(STR, "abc"))
    edit("head-count-kv-0", "llama.attention.head_count_kv is 0", llama__attention__head_count_kv=(U32, 0))
    edit("vocab-size-1e9", "llama.vocab_size is 1,000,000,000 but token_embd.weight has 512 rows",
         llama__vocab_size=(U32, 10**9))
    edit("hidden-1e6", "llama.embedding_length is 1,000,000 but token_embd.weight rows are 64 wide",
         llama__embedding_length=(U64, 10**6))
    edit("head-count-1e6", "llama.attention.head_count is 1,000,000", llama__attention__head_count=(U32, 10**6))
    edit("ffn-wrong", "llama.feed_forward_length is 4,096 but blk.0.ffn_up.weight has 172 rows",
         llama__feed_forward_length=(U32, 4096))
    edit("eps-string", "llama.attention.layer_norm_rms_epsilon is a string ('tiny'), not a number",
         llama__attention__layer_norm_rms_epsilon=(STR, "tiny"))
    edit("rope-nan", "llama.rope.freq_base is nan", llama__rope__freq_base=(F32, float("nan")))

    g = raw.read(d / "base.gguf").set_raw("tokenizer.ggml.tokens", ARR, raw.strings(f"t{i}" for i in range(10**6)))
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        g.drop(key)
    cases["vocab-1e6"] = Case(g.write(d / "vocab-1e6.gguf"),
                              "its tokenizer has 1,000,000 tokens but token_embd.weight has 512 rows")
    g = raw.read(d / "base.gguf").set_raw("tokenizer.ggml.tokens", ARR, raw.strings(["<unk>", "<s>", "</s>"]))
    g.drop("tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    cases["vocab-3"] = Case(g.write(d / "vocab-3.gguf"), "its tokenizer has 3 tokens for 512 embedding rows")

    g = raw.read(d / "base.gguf")
    embd = g.tensor("token_embd.weight")
    embd.shape = (embd.shape[0], 4)
    cases["embd-4rows"] = Case(g.write(d / "embd-4rows.gguf"), "token_embd.weight has 4 rows")

    for name, arch, expect in (("t5-no-tensors", "t5", "an encoder-decoder model"),
                               ("no-architecture", None, "names no architecture")):
        g = raw.RawGguf().set("general.name", STR, name)
        if arch:
            g.set("general.architecture", STR, arch)
        cases[name] = Case(g.write(d / f"{name}.gguf", pad_data=False), expect)
    g = raw.RawGguf().set("general.architecture", STR, "llama").set("split.count", raw.U16, 2)
    cases["part-missing"] = Case(g.write(d / "part-00001-of-00002.gguf", pad_data=False),
                                 "split in 2 files and 1 is missing (part-00002-of-00002.gguf)")
    for name, text in TEMPLATES.items():
        g = raw.read(d / "base.gguf").set("tokenizer.chat_template", STR, text)
        cases[name] = Case(g.write(d / f"{name}.gguf"), "chat template", chat=True)
    return cases


def _folder_cases(d: Path, stories_path: Path) -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for name, value, expect in (("config-abc", "abc", "max_position_embeddings is a string ('abc')"),
                                ("config-1e400", 1e400, "max_position_embeddings is inf"),
                                ("config-list", [1, 2], "max_position_embeddings is a list")):
        folder = d / name
        shutil.copytree(stories_path, folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["max_position_embeddings"] = value
        (folder / "config.json").write_text(json.dumps(cfg))  # 1e400 is written as Infinity, as Python reads it
        cases[name] = Case(folder, expect)
    folder = d / "folder-template"
    shutil.copytree(stories_path, folder)
    (folder / "chat_template.jinja").write_text(NESTED_LOOPS)
    cases["folder-template"] = Case(folder, "chat template", chat=True)
    return cases


def make(folder: Path, stories_path: Path) -> dict[str, Case]:
    """Every hostile case under ``folder`` (made once; about a second)."""
    folder.mkdir(parents=True, exist_ok=True)
    _stories_gguf(folder, stories_path)
    base = raw.read(folder / "base.gguf")
    return {**_gguf_cases(folder, base), **_folder_cases(folder, stories_path)}


def messages_file(folder: Path) -> Path:
    path = folder / "chat.json"
    path.write_text(json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]))
    return path
