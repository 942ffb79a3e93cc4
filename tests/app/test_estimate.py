"""The models dialog's memory estimate (torch-free) uses the engine's byte formulas."""

from __future__ import annotations

import pytest

from app.estimate import quantized_bytes_per_token
from engine.kv import quant


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("head_dim", [7, 8, 64, 80, 128])
@pytest.mark.parametrize("page_size", [1, 8, 16, 128, 256])
def test_quantized_bytes_per_token_equals_the_engines(kind, role, head_dim, page_size):
    assert quantized_bytes_per_token(kind, role, 3, head_dim, page_size) == quant.bytes_per_token(
        kind, role, 3, head_dim, page_size)
