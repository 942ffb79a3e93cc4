"""Every persisted setting, declared once (key, type, default), over an INI-format ``QSettings``.

Add a setting by adding one ``Setting`` line to ``SETTINGS``; reading or writing an undeclared key is a
``KeyError``, never a silent ``None``. Tests build the store with ``Settings.from_file(tmp_path / "s.ini")``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, QStandardPaths

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Setting:
    """One persisted value: its key (``section/name``), Python type and default."""

    key: str
    type: type
    default: Any


SETTINGS: tuple[Setting, ...] = (
    # model
    Setting("model/last", str, "demo"),
    Setting("model/recent", list, []),
    Setting("model/quantization", str, "none"),
    Setting("model/device", str, "auto"),
    Setting("model/context", int, 2048),
    # cache policy (mirrors engine.config.CacheConfig)
    Setting("cache/mode", str, "paged"),
    Setting("cache/page_size", int, 16),
    Setting("cache/prefix_reuse", bool, True),
    Setting("cache/k_dtype", str, "auto"),
    Setting("cache/v_dtype", str, "auto"),
    Setting("cache/policy", str, "none"),
    Setting("cache/policy_params", dict, {}),
    Setting("cache/overflow", str, "stop"),
    # sampling defaults for new chats (mirrors engine.config.SamplingConfig)
    Setting("sampling/temperature", float, 0.7),
    Setting("sampling/top_k", int, 40),
    Setting("sampling/top_p", float, 0.95),
    Setting("sampling/min_p", float, 0.05),
    Setting("sampling/repetition_penalty", float, 1.1),
    Setting("sampling/seed", int, -1),  # -1: random
    Setting("sampling/max_new_tokens", int, 256),
    # window
    Setting("window/geometry", bytes, b""),
    Setting("window/state", bytes, b""),
    Setting("window/last_chat", int, -1),
    Setting("panels/enabled", bool, True),
    Setting("meta/schema_version", int, SCHEMA_VERSION),
)
_BY_KEY = {s.key: s for s in SETTINGS}


def _decode(setting: Setting, raw: Any) -> Any:
    """Turn what QSettings hands back (strings, in INI files) into the declared type."""
    t = setting.type
    if raw is None:
        return setting.default
    try:
        if t is bool:
            if isinstance(raw, str):
                return raw.strip().lower() in ("1", "true", "yes", "on")
            return bool(raw)
        if t is int:
            return int(raw)
        if t is float:
            return float(raw)
        if t is str:
            return str(raw)
        if t is bytes:
            if isinstance(raw, QByteArray):
                return bytes(raw.data())
            if isinstance(raw, (bytes, bytearray)):
                return bytes(raw)
            return setting.default
        if t in (list, dict):
            value = json.loads(raw) if isinstance(raw, str) else raw
            return value if isinstance(value, t) else setting.default
    except (ValueError, TypeError, json.JSONDecodeError):
        return setting.default
    return setting.default


class Settings:
    """Typed access to the declared settings, stored in one INI file."""

    def __init__(self, qsettings: QSettings) -> None:
        self._q = qsettings
        if self._q.value("meta/schema_version") is None:
            self._q.setValue("meta/schema_version", SCHEMA_VERSION)

    @classmethod
    def from_file(cls, path: str | Path) -> "Settings":
        """A store backed by ``path`` (created on first write)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return cls(QSettings(str(path), QSettings.Format.IniFormat))

    @classmethod
    def from_data_dir(cls, data_dir: Path) -> "Settings":
        return cls.from_file(Path(data_dir) / "settings.ini")

    @property
    def path(self) -> str:
        return self._q.fileName()

    def get(self, key: str) -> Any:
        setting = _BY_KEY[key]  # KeyError for undeclared keys, on purpose
        return _decode(setting, self._q.value(key))

    def set(self, key: str, value: Any) -> None:
        setting = _BY_KEY[key]
        if setting.type in (list, dict):
            self._q.setValue(key, json.dumps(value))
        elif setting.type is bytes:
            self._q.setValue(key, QByteArray(bytes(value)))
        elif setting.type is bool:
            self._q.setValue(key, "true" if value else "false")
        else:
            self._q.setValue(key, setting.type(value))

    def reset(self, key: str) -> None:
        self._q.remove(_BY_KEY[key].key)

    def sync(self) -> None:
        self._q.sync()

    def add_recent_model(self, source: str, limit: int = 10) -> list[str]:
        recent = [s for s in self.get("model/recent") if s != source]
        recent.insert(0, source)
        recent = recent[:limit]
        self.set("model/recent", recent)
        return recent


def default_data_dir() -> Path:
    """The platform data dir (QStandardPaths AppDataLocation), overridable by ``KVSCOPE_DATA_DIR``."""
    import os

    env = os.environ.get("KVSCOPE_DATA_DIR")
    if env:
        return Path(env).expanduser()
    loc = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation)
    if not loc:
        loc = str(Path.home() / ".local" / "share" / "kvscope")
    return Path(loc)
