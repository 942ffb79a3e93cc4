"""A model whose output is NaN ends the reply with a clear error instead of "answering" token 0 (#20 item 17).

Greedy argmax of an all-NaN logits row is token 0, so a model with NaN weights used to stream ``<unk>``
until max_new_tokens; sampling raised torch's "probability tensor contains inf / nan" as an internal error.
The folder is stories260K with its final norm set to NaN: every logit is NaN from the first token.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from engine import errors
from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.model.loader import load_model
from engine.core.session import ChatSession


@pytest.fixture(scope="module")
def nan_folder(tmp_path_factory, stories_path):
    from safetensors.torch import load_file, save_file

    dst = tmp_path_factory.mktemp("nan") / "nan-model"
    dst.mkdir()
    for f in stories_path.iterdir():
        shutil.copy(f, dst / f.name)
        (dst / f.name).chmod(0o644)
    sd = load_file(dst / "model.safetensors")
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], float("nan"))
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


MESSAGE = ("the model's output is not a number (NaN in its logits): its weights hold NaN/inf or its dtype "
           "overflowed (try float32); the reply was stopped")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cli_says_so_in_one_line(nan_folder, temperature):
    p = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(nan_folder), "--prompt",
                        "Once upon a time", "--max-new-tokens", "8", "--offline", "--temperature", str(temperature)],
                       capture_output=True, text=True, timeout=600)
    said = [line for line in p.stderr.splitlines() if not line.startswith("note: ")]  # the memory verdict
    assert (p.returncode, p.stdout, said) == (2, "", [f"error: {MESSAGE}"])


def test_the_turn_ends_cleanly_and_the_session_goes_on(nan_folder):
    lm = load_model(ModelSpec(source=str(nan_folder), device="cpu", allow_download=False))
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16))
    sampling = SamplingConfig(max_new_tokens=8, ignore_eos=True)
    for _ in range(2):  # the same error each time: the first one left nothing half done
        s.start_completion("Once upon a time", sampling)
        with pytest.raises(errors.NonFiniteLogitsError) as info:
            for _ in range(20):
                if s.step().done:
                    break
        assert str(info.value) == MESSAGE
        assert s.generated_ids == []  # no token 0 was emitted
    s.close()
    assert all(a.pool.num_used == 0 for a in lm.kv_arenas)  # its pages went back


def test_a_healthy_model_is_not_refused(stories):
    s = ChatSession(stories, CacheConfig(mode="paged", page_size=16))
    try:
        s.start_completion("Once upon a time", SamplingConfig(max_new_tokens=4, ignore_eos=True))
        while not s.step().done:
            pass
        assert len(s.generated_ids) == 4
    finally:
        s.close()
