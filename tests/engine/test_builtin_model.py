"""The model shipped in ``resources/models/stories260K``: found without anything beside the checkout (source
tree, installed wheel, PyInstaller bundle), loaded by name, and the genuine pretrained weights."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from engine.model.builtin import BUILTIN_MODEL, builtin_model_dir
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.model.loader import load_model, resolve_source
from engine.core.session import ChatSession

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "resources" / "models" / "stories260K"
# greedy from BOS alone, as the model's README (and llama2.c's published sample) gives them
FIRST_IDS = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337]


def test_the_checkout_ships_the_model_with_its_licence_and_provenance():
    assert builtin_model_dir() == SHIPPED
    files = {p.name for p in SHIPPED.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
            "tokenizer_config.json", "README.md"} <= files
    readme = (SHIPPED / "README.md").read_text(encoding="utf-8")
    assert "License: MIT" in readme and "Copyright (c) 2023 Andrej" in readme and "## Where it came from" in readme
    stated = re.search(r"sha256 of `model.safetensors`: `([0-9a-f]{64})`", readme).group(1)
    assert hashlib.sha256((SHIPPED / "model.safetensors").read_bytes()).hexdigest() == stated


def test_loaded_by_name_it_writes_the_published_story():
    lm = load_model(BUILTIN_MODEL)
    assert (lm.info.name, lm.info.source, lm.path, lm.info.is_demo) == ("stories260K", "stories260K", str(SHIPPED),
                                                                         False)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    s.start_ids([1], SamplingConfig(temperature=0.0, max_new_tokens=len(FIRST_IDS), ignore_eos=True))
    while not s.step().done:
        pass
    assert s.generated_ids == FIRST_IDS
    assert lm.tokenizer.decode(FIRST_IDS).startswith("Once upon a time, there was a little girl named Lily.")
    s.close()


def test_the_name_is_case_blind_and_a_local_folder_of_that_name_wins(tmp_path, monkeypatch):
    assert resolve_source(ModelSpec(source="STORIES260k")) == SHIPPED
    local = tmp_path / "stories260K"
    local.mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_source(ModelSpec(source="stories260K")) == Path("stories260K")


def test_a_frozen_bundle_finds_its_own_copy(tmp_path, monkeypatch):
    """PyInstaller puts ``resources/`` at ``sys._MEIPASS``; a bundle without the model falls back to nothing
    outside the project, only the checkout the engine was imported from."""
    bundled = tmp_path / "resources" / "models" / "stories260K"
    shutil.copytree(SHIPPED, bundled)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert builtin_model_dir() == bundled
    shutil.rmtree(bundled)
    assert builtin_model_dir() == SHIPPED


def test_an_installed_wheel_carries_the_model(tmp_path):
    """The wheel puts ``resources/`` beside ``engine/`` in site-packages, where ``builtin_model_dir`` looks."""
    src = tmp_path / "src"  # setuptools builds in the source folder: a copy keeps build/ out of the checkout
    for part in ("app", "engine", "resources"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, cwd=tmp_path, env=env, capture_output=True)
    wheel = next((tmp_path / "dist").glob("kvscope-*.whl"))
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--no-compile", "--target", str(site), str(wheel)],
                   check=True, env=env, capture_output=True)
    probe = ("import engine, engine.model.builtin as b; d = b.builtin_model_dir(); "
             "print(engine.__file__); print(d); print(sorted(p.name for p in d.iterdir()))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=dict(env, PYTHONPATH=str(site)),
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == str(site / "engine" / "__init__.py")
    assert out[1] == str(site / "resources" / "models" / "stories260K")
    assert out[2] == str(sorted(p.name for p in SHIPPED.iterdir() if p.is_file()))
