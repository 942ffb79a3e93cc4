"""Tokens a prefill forward feeds at once (``prefill_chunk``): the sessions chunk prompts by it, and the memory
estimate before a load (``engine.model.fit``) sizes a chunk's activations by it."""

from __future__ import annotations

# A chunk is ~6e11 FLOPs: ~1.5 s of prefill on this 2-core CPU with the GGUF block kernels (~400 GFLOP/s), well
# under a second on an 8-core laptop. Smaller chunks cost TTFT: a 4,096-token prompt of a Gemma-3-1B shape took
# x1.39 of one forward in 128-token chunks (every chunk attends through an explicit mask). A chunk's activations
# are the prefill's memory beside the weights and the cache: a Llama-3.2-1B shape's 1,024-token prompt peaked
# 70-100 MB lower in 256-token chunks than in 512 (1,485 against 1,553-1,589 MB as Q8_0, one thread).
CHUNK_FLOPS_CPU = 6e11
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
