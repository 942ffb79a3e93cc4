"""KV Scope engine: Hugging Face models with the project's own paged KV cache. Never imports Qt.

Importing ``engine`` is light (configs, snapshots, errors); torch and transformers load on first use of
``load_model`` / ``ChatSession``.
"""

import os as _os

from engine.model.aot_step import inductor_cache_dir as _inductor_cache_dir

# before torch: its first look at its cache folder would otherwise fix it to /tmp (engine.model.aot_step)
_os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())

from engine.config import CacheConfig, ModelSpec, SamplingConfig  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.snapshot import CacheSnapshot, ModelInfo, StepResult, TokenEvent, TurnStats  # noqa: E402

__all__ = [
    "CacheConfig", "ModelSpec", "SamplingConfig", "EngineError", "CacheSnapshot", "ModelInfo", "StepResult",
    "TokenEvent", "TurnStats", "load_model", "ChatSession", "LoadedModel",
]


def __getattr__(name: str):
    if name in ("load_model", "LoadedModel"):
        from engine.model import loader

        return getattr(loader, name)
    if name == "ChatSession":
        from engine.core.session import ChatSession

        return ChatSession
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
