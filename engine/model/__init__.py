"""Models: checking files before loading (``model_files``, ``weight_index``), loading (``loader``: HF weights,
bitsandbytes, the built-in stories260K, demo models and random-weight shapes), what each layer caches
(``arch``), chat templates and streaming text (``chat``), CPU threads, and ``ModelRunner`` — the only code that
calls the model — with its compiled decode step (``fast_step``, ``aot_step``, ``aot_build``).

May import ``engine.kv`` (the runner feeds the cache's transformers view) and the public face; never the core.
"""
