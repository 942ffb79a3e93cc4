"""A folder's weights read tensor by tensor (``engine.model.weights_read``): transformers gets a state dict of
``pread`` slices instead of mapping the files. The tensors, the loading report and the generation config are what
``from_pretrained(folder)`` gives (MoE experts merged by transformers' conversions, GPT-2's Conv1D and tied head,
Phi-3's fused projections included; every causal-LM type of the zoo was checked once by hand), and no weights file
is ever memory-mapped by the load: the pages of the file are not held beside the weights kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import arch_zoo  # tests/engine is on sys.path

from engine.config import ModelSpec
from engine.model import weights_read
from engine.model.loader import load_model

TYPES = ("llama", "gpt2", "mixtral", "qwen2_moe", "phi3", "gemma3_text")


@pytest.mark.parametrize("model_type", TYPES)
def test_the_same_model_as_from_pretrained(model_type, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model, _ = arch_zoo.tiny_model(model_type)
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    kw = dict(dtype=torch.float32, output_loading_info=True)
    want, want_info = AutoModelForCausalLM.from_pretrained(str(tmp_path), **kw)
    got, got_info = weights_read.from_folder(tmp_path, config, kw)
    a, b = want.state_dict(), got.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert sorted(map(str, want_info[key])) == sorted(map(str, got_info[key]))
    assert want.generation_config.to_dict() == got.generation_config.to_dict()


def _mapped(files: list[Path]) -> list[str]:
    names = {str(f.resolve()) for f in files}
    with open("/proc/self/maps") as maps:
        return [line for line in maps if line.split()[-1] in names]


@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_no_weights_file_is_mapped_while_loading(stories_path, quant):
    """At every tensor's progress step the process maps none of the safetensors files (transformers' own reading
    kept the whole file mapped until the end, each page it had read resident)."""
    files = list(stories_path.glob("*.safetensors"))
    seen: list[list[str]] = []
    lm = load_model(ModelSpec(source=str(stories_path), quantization=quant, device="cpu"),
                    progress=lambda m, f: seen.append(_mapped(files)) if "tensor" in m else None)
    assert seen and not any(seen), seen[:1]
    assert not _mapped(files) and lm.info.weights_bytes > 0
