"""KV quantization: one class per scheme (int8, int4; per channel / per token), K and V kept at full
precision or quantized (``roles``), quantized pages. May import ``engine.kv.paged``.
"""
