"""Where K and V live: page arenas and their limits, paged / contiguous / host stores, sliding-window groups,
models whose layers differ (``grouped``), recurrent and convolution state, attention over pages, per-layer
re-rotation. May import ``engine.kv.paged`` and ``engine.kv.quantized``.
"""
