"""The models dialog's memory verdict (torch-free to import) is the engine's, with the cache's byte formulas."""

from __future__ import annotations

import pytest

import subprocess
import sys

import torch

from engine.kv.paged import sizes
from engine.kv.quantized.schemes import scheme_for


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("head_dim", [7, 8, 64, 80, 128])
@pytest.mark.parametrize("page_size", [1, 8, 16, 128, 256])
def test_pages_hold_what_the_torch_free_formula_says(kind, role, head_dim, page_size):
    """The estimate (app) and the cache (engine) share ``engine.kv.paged.sizes``; the real pages agree with it."""
    scheme = scheme_for(kind, role, head_dim, page_size)
    q = scheme.quantize(torch.randn(3, page_size, head_dim))  # [H, P, D]: one page of 3 heads
    assert q.nbytes / page_size == sizes.bytes_per_token(kind, role, 3, head_dim, page_size)
    assert scheme.bytes_per_token(3) == sizes.bytes_per_token(kind, role, 3, head_dim, page_size)


def test_the_estimate_imports_no_torch():
    code = "import sys, app.models.estimate; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_estimate_counts_sliding_windows_and_state_layers():
    from engine.model.fit import attention_of

    gemma3 = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "hidden_size": 1152, "sliding_window": 512, "max_position_embeddings": 32768,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "torch_dtype": "bfloat16"}
    per_layer = 2 * 1 * 256 * 2
    # not 6 x 4096; a window holds 511 besides the query
    assert attention_of(gemma3).cache_bytes("auto", 2, 4096) == per_layer * (1 * 4096 + 5 * 511)
    hybrid = dict(gemma3, layer_types=["conv", "full_attention"] * 3, sliding_window=None)
    assert attention_of(hybrid).cache_bytes("auto", 2, 4096) == per_layer * 3 * 4096
