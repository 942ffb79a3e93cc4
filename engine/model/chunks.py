"""Tokens a prefill forward feeds at once (``prefill_chunk``): the sessions chunk prompts by it, and the memory
estimate before a load (``engine.model.fit``) sizes a chunk's activations by it."""

from __future__ import annotations

# A chunk is ~1e12 FLOPs: ~5 s of prefill on this 2-core CPU (~200 GFLOP/s), ~1 s on an 8-core laptop. Smaller
# chunks cost TTFT: a 4,096-token prompt of a Gemma-3-1B shape took x1.39 of one forward in 128-token chunks
# (every chunk attends through an explicit mask); 512-token chunks keep Stop within seconds.
CHUNK_FLOPS_CPU = 1.2e12
CHUNK_FLOPS_GPU = 2e13  # the same wait on a consumer GPU
MIN_CHUNK, MAX_CHUNK = 64, 2048


def prefill_chunk(num_params: int, device_type: str) -> int:
    """Tokens per prefill forward, so that Stop acts within about a second or two: ~2 FLOPs per parameter per
    token, rounded down to a power of two in 64..2048. A fixed number per model and device, so chunking
    never depends on timing (and a prompt that fits one chunk is prefilled exactly as HF does)."""
    budget = CHUNK_FLOPS_CPU if device_type == "cpu" else CHUNK_FLOPS_GPU
    tokens = budget / max(1, 2 * num_params)
    chunk = MIN_CHUNK
    while chunk * 2 <= min(tokens, MAX_CHUNK):
        chunk *= 2
    return chunk
