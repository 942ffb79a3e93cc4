"""``EngineBackend``: how the worker reaches the engine. Tests inject fakes; the default imports torch lazily
(on the worker thread, after the window is shown)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from engine.config import CacheConfig, ModelSpec, SamplingConfig


@dataclass
class EngineBackend:
    """Factories the worker calls on its own thread."""

    load: Callable[[ModelSpec, Callable[..., None], threading.Event], Any]  # (spec, progress, cancel)
    make_session: Callable[[Any, CacheConfig], Any]
    probe: Callable[[], dict] = lambda: {}
    # One session per chat (``engine.core.session_pool.SessionPool``); None: one session for every chat.
    make_pool: Callable[[Any, CacheConfig], Any] | None = None
    # (loaded, messages, sampling) -> a stepwise comparison (``engine.tools.compare.Comparison``: ``step()`` gives
    # a row with ``as_dict()`` or None, ``done``, ``cancel()``, ``close()``); None: comparing is not offered.
    make_comparison: Callable[[Any, list[dict], SamplingConfig], Any] | None = None


def default_backend() -> EngineBackend:
    """The real engine. Imports torch/transformers on the calling (worker) thread."""

    def load(spec: ModelSpec, progress: Callable[..., None], cancel: threading.Event) -> Any:
        from engine.model.loader import load_model

        return load_model(spec, progress=progress, cancel=cancel)

    def make_session(loaded: Any, cache: CacheConfig) -> Any:
        from engine.core.session import ChatSession

        return ChatSession(loaded, cache)

    def make_pool(loaded: Any, cache: CacheConfig) -> Any:
        from engine.core.session_pool import SessionPool

        return SessionPool(loaded, cache)

    def make_comparison(loaded: Any, messages: list[dict], sampling: SamplingConfig) -> Any:
        from engine.tools.compare import Comparison

        return Comparison(loaded, messages, sampling)

    def probe() -> dict:
        import torch

        info: dict[str, Any] = {"cuda": bool(torch.cuda.is_available()), "device_total_bytes": 0}
        if info["cuda"]:
            free, total = torch.cuda.mem_get_info()
            info.update(device_total_bytes=int(total), device_free_bytes=int(free),
                        device_name=torch.cuda.get_device_name(0))
        return info

    return EngineBackend(load=load, make_session=make_session, probe=probe, make_pool=make_pool,
                         make_comparison=make_comparison)
