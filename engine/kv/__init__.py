"""The project's own KV cache, in rooms: ``paged`` (bookkeeping in plain ints), ``store`` (where K and V live),
``quantized`` (KV int8 / int4), ``tier`` (the disk tier), and ``hf_cache`` — the only module that knows
transformers' Cache API. Never imports the core, the server, the model runner or the tools.
"""
