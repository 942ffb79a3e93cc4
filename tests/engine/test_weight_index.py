"""A config.json with more layers than the weight files hold is refused before any model is built (#20 item 14).

Before: 2,000 layers built for 16 s / 0.8 GB before "17955 weights missing"; 200,000 never finished. The
refusal must come before torch registers a single parameter (counted with torch's global registration
hook, which fires for meta-device skeletons too), with one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from torch.nn.modules.module import register_module_parameter_registration_hook

from engine import errors
from engine.config import ModelSpec
from engine.model.loader import load_model
from engine.model.weight_index import layer_stacks


def _copy(stories_path, dst, **config):
    dst.mkdir()
    for f in stories_path.iterdir():
        shutil.copy(f, dst / f.name)
        (dst / f.name).chmod(0o644)  # the shared copy is read-only
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


class _Params:
    """How many parameters torch registers on any module while inside (0: no model was built)."""

    def __enter__(self):
        self.count = 0
        self._handle = register_module_parameter_registration_hook(self._hook)
        return self

    def _hook(self, module, name, param):
        self.count += 1

    def __exit__(self, *exc):
        self._handle.remove()


@pytest.mark.parametrize("layers", [6, 2_000, 200_000])
def test_more_layers_than_the_files_is_refused_before_building(tmp_path, stories_path, layers):
    folder = _copy(stories_path, tmp_path / "m", num_hidden_layers=layers)
    with _Params() as params, pytest.raises(errors.ModelFormatError) as info:
        load_model(ModelSpec(source=str(folder), device="cpu", allow_download=False))
    assert str(info.value) == (
        f"m: config.json says num_hidden_layers {layers} but the weight files hold 5 (model.layers.0..4) layers: "
        "re-download the model, or use the config.json that came with these weights")
    assert params.count == 0


def test_the_hook_sees_a_model_being_built(tmp_path, stories_path):
    """The counter above can fail: a good folder registers the model's parameters."""
    folder = _copy(stories_path, tmp_path / "ok")
    with _Params() as params:
        lm = load_model(ModelSpec(source=str(folder), device="cpu", allow_download=False))
    assert lm.info.num_layers == 5
    assert params.count >= 47  # 47 tensors in the file, plus the meta skeleton's


def test_cli_refuses_in_one_line_with_exit_2(tmp_path, stories_path):
    folder = _copy(stories_path, tmp_path / "big", num_hidden_layers=200_000)
    p = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(folder), "--prompt", "hi",
                        "--device", "cpu", "--offline", "--max-new-tokens", "1"],
                       capture_output=True, text=True, timeout=600)  # a hang guard only: before, it never ended
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("error: big: config.json says num_hidden_layers 200000 but the weight files hold 5")


def test_pickle_checkpoints_are_counted_by_their_own_index(tmp_path, stories_path):
    """Sharded pickle weights: the names come from each checkpoint unpickled onto the meta device."""
    import torch
    from safetensors.torch import load_file

    folder = _copy(stories_path, tmp_path / "p", num_hidden_layers=40)
    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    shards = {"pytorch_model-1.bin": {k: v for k, v in sd.items() if "layers" not in k},
              "pytorch_model-2.bin": {k: v for k, v in sd.items() if k.startswith("model.layers.")}}
    for file, part in shards.items():
        torch.save(part, folder / file)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}))
    with _Params() as params, pytest.raises(errors.ModelFormatError) as info:
        load_model(ModelSpec(source=str(folder), device="cpu", allow_download=False, allow_pickle=True))
    assert "num_hidden_layers 40 but the weight files hold 5 (model.layers.0..4) layers" in str(info.value)
    assert params.count == 0
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))  # the right count loads
    lm = load_model(ModelSpec(source=str(folder), device="cpu", allow_download=False, allow_pickle=True))
    assert lm.info.num_layers == 5


def test_layer_stacks_count_the_first_number_only():
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.experts.63.w1", "model.layers.11.norm.weight",
             "vision.blocks.2.attn.qkv.weight", "lm_head.weight"]
    assert layer_stacks(names) == {"model.layers": 12, "vision.blocks": 3}
