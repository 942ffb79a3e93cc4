"""The link to the engine: ``EngineWorker`` on its ``QThread`` (the engine core's rounds, the chats' session
pool, comparisons), ``EngineThread`` (the GUI side's handle: queued calls, signals) and ``EngineBackend`` (how
the worker reaches the engine; tests inject fakes). The only room that imports torch-touching engine code,
on the worker thread. May import ``app.ground.failure``, ``app.controls``' engine-side helpers, ``engine``.
"""
