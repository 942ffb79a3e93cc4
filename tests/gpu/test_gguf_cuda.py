"""GGUF blocks on a CUDA GPU (``engine.quant``): a file with every block type transformers' GPU path reads (Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) stays as blocks in the GPU's memory, copied there tensor by tensor as the model is
built; Q5_0 (no GPU dequantizer in transformers) is dequantized on load; greedy tokens equal HF ``generate``'s on
the model dequantized from the same file, float32 on the GPU. Run by ``tests/gpu/run.sh`` (skipped without CUDA;
``KVSCOPE_GPU_TEST_DEVICE=cpu`` runs the same checks on the CPU kernels).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # gguf_blocks, gguf_make

from engine.config import CacheConfig, ModelSpec, SamplingConfig  # noqa: E402
from engine.core.session import ChatSession  # noqa: E402
from engine.model.loader import load_model  # noqa: E402

DEVICE = os.environ.get("KVSCOPE_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="no CUDA device (torch.cuda.is_available() is False)")]
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0")
PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 79, 63, 115, 151]
N = 16


def _record(name: str, **figures) -> None:
    line = json.dumps({"check": name, **figures})
    print(line)
    path = os.environ.get("KVSCOPE_GPU_FIGURES")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, stories_path):
    from gguf_blocks import cycle, write_blocks
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("gguf-gpu") / "mixed.gguf"
    return write_blocks(model, "llama", stories_path / "tokenizer.model", path, cycle(TYPES))


def test_gguf_blocks_stay_blocks_on_the_gpu(mixed, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("KVSCOPE_GGUF_ROAD", "float")  # the CPU dry run's kernels like the GPU's: float activations
    from engine.quant.modules import BlockLinear

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    lm = load_model(ModelSpec(source=str(mixed), device=DEVICE, dtype="float32"))
    blocks = [m for m in lm.model.modules() if isinstance(m, BlockLinear)]
    assert blocks and all(m.weight.device.type == DEVICE and m.weight.dtype == torch.uint8 for m in blocks)
    kinds = {m.ggml_type for m in blocks}
    assert 6 not in kinds or DEVICE == "cpu"  # Q5_0: dequantized on the GPU (transformers has no GPU path for it)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=4))
    s.start_ids(PROMPT, SamplingConfig(max_new_tokens=N, ignore_eos=True))
    while not s.step().done:
        pass
    got = s.generated_ids
    ref_model = AutoModelForCausalLM.from_pretrained(str(mixed.parent), gguf_file=str(mixed),
                                                     dtype=torch.float32).to(DEVICE).eval()
    x = torch.tensor([PROMPT], device=DEVICE)
    with torch.inference_mode():
        ref = ref_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, min_new_tokens=N,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    held = sum(m.weight.numel() for m in blocks)
    _record("gguf_blocks_on_device", device=DEVICE, block_layers=len(blocks), block_bytes=held,
            peak_gpu_bytes=torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0, tokens_equal=got == ref)
    assert got == ref
