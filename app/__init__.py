"""KV Scope desktop app (PySide6 + pyqtgraph).

Imports only the engine's light public API (config, snapshot, errors) on the GUI thread; everything that
touches torch is imported lazily by :class:`app.link.worker.EngineWorker` on its own thread.
"""

from app._pyside_fix import protect_singletons

protect_singletons()

__version__ = "0.1.0"
