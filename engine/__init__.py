"""KV Scope engine: Hugging Face models with the project's own paged KV cache. Never imports Qt.

Importing ``engine`` is light (configs, snapshots, errors); torch and transformers load on first use of
``load_model`` / ``ChatSession``.
"""

from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.errors import EngineError
from engine.snapshot import CacheSnapshot, ModelInfo, StepResult, TokenEvent, TurnStats

__all__ = [
    "CacheConfig", "ModelSpec", "SamplingConfig", "EngineError", "CacheSnapshot", "ModelInfo", "StepResult",
    "TokenEvent", "TurnStats", "load_model", "ChatSession", "LoadedModel",
]


def __getattr__(name: str):
    if name in ("load_model", "LoadedModel"):
        from engine import loader

        return getattr(loader, name)
    if name == "ChatSession":
        from engine.session import ChatSession

        return ChatSession
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
