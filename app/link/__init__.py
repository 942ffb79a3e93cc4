"""The link to the engine: ``EngineWorker`` on its ``QThread`` (the engine core's rounds, the chats' session
pool, comparisons), ``EngineThread`` (the GUI side's handle: queued calls, signals) and ``EngineBackend`` (how
the worker reaches the engine; tests inject fakes). The only room that imports torch-touching engine code,
on the worker thread, with the jobs that run there (a comparison, the fidelity check, the KV disk tier's control,
speculation's draft models). May import the ground, ``app.settings``, ``engine``; never ``app.controls`` or
``app.compare``, which import it.
"""
