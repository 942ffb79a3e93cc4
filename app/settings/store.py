"""Every persisted setting, declared once (key, type, default), over an INI-format ``QSettings``.

Add a setting by adding one ``Setting`` line to ``SETTINGS``; reading or writing an undeclared key is a
``KeyError``, never a silent ``None``. Tests build the store with ``Settings.from_file(tmp_path / "s.ini")``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSettings, QStandardPaths

from engine.model.builtin import BUILTIN_MODEL
from engine.config import CacheConfig, SamplingConfig, SpecConfig

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Setting:
    """One persisted value: its key (``section/name``), Python type and default."""

    key: str
    type: type
    default: Any


# The app's defaults for new chats where they differ from SamplingConfig's (which are the CLI's: greedy).
SAMPLING_DEFAULTS = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
CACHE_SKIP = ("max_pages",)  # engine-only (tests, benchmarks): not a user setting
# The app's cache defaults where they differ from CacheConfig's (the CLI's: exact, nothing dropped). A chat goes on
# past the model's context, its oldest whole turns dropped (never the system prompt or a pinned message) and said so
# under the reply.
CACHE_DEFAULTS = {"overflow": "turns"}
# per request, not persisted (the penalties and logprobs are the OpenAI API's; the sampling form has none)
SAMPLING_SKIP = ("ignore_eos", "stop_strings", "presence_penalty", "frequency_penalty", "logprobs", "grammar")


def dataclass_settings(prefix: str, cls: type, skip: tuple[str, ...] = (),
                       defaults: dict[str, Any] | None = None) -> tuple[Setting, ...]:
    """One ``Setting`` per field of the config dataclass ``cls`` (``prefix/field``), typed by its default,
    so a field added to ``CacheConfig`` or ``SamplingConfig`` is persisted without another list to edit.
    An ``Optional[int]`` field whose default is None (the seed) is stored as -1."""
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = (defaults or {}).get(f.name, f.default if f.default is not dataclasses.MISSING
                                       else f.default_factory())  # type: ignore[misc]
        if default is None:
            default = -1
        out.append(Setting(f"{prefix}/{f.name}", type(default), default))
    return tuple(out)


SETTINGS: tuple[Setting, ...] = (
    # model
    Setting("model/last", str, BUILTIN_MODEL),  # the shipped stories260K: real text on first launch
    Setting("model/recent", list, []),
    Setting("model/quantization", str, "none"),
    Setting("model/device", str, "auto"),
    Setting("model/context", int, 2048),
    Setting("model/folders", list, []),  # folders of models the Models dialog lists (engine.model.catalog)
    Setting("model/defaults", dict, {}),  # a model's own settings for its new chats (app.settings.model_defaults)
    *dataclass_settings("cache", CacheConfig, CACHE_SKIP, CACHE_DEFAULTS),
    *dataclass_settings("sampling", SamplingConfig, SAMPLING_SKIP, SAMPLING_DEFAULTS),
    *dataclass_settings("spec", SpecConfig),  # speculative decoding (app.controls.spec_controller)
    Setting("spec/tint", bool, False),  # accepted draft tokens tinted in the replies
    # window
    Setting("window/geometry", bytes, b""),
    Setting("window/state", bytes, b""),
    Setting("window/last_chat", int, -1),
    Setting("panels/enabled", bool, True),
    Setting("engine/fast_step", bool, True),  # the compiled decode step (engine.model.fast_step), Tools menu
    # Server ▸ Start serving (app.server.address): 127.0.0.1 unless the user lets other machines in (Settings ▸ Server)
    Setting("server/port", int, 8000),
    Setting("server/remote", bool, False),  # the opt-in: listen on server/host, which then needs an API key
    Setting("server/host", str, "0.0.0.0"),  # read only with server/remote
    Setting("server/api_keys", list, []),  # in plain text, as the CLI's --api-key is on its command line
    Setting("chat/system_prompt", str, ""),  # Settings ▸ New chats: each new chat starts with it
    # Settings ▸ Tools (app.agent): MCP servers' tools in chats, off by default; each call asks first
    Setting("mcp/enabled", bool, False),
    Setting("mcp/servers", list, []),  # [{"name", "command", "on"}]: stdio servers, a command line each
    Setting("mcp/tool_choice", str, "auto"),  # "first": the reply to each message of yours calls a tool
    # what the fidelity check measured per model and setting (app.controls.lossy): said before a lossy one is used
    Setting("fidelity/measured", dict, {}),
    Setting("export/folder", str, ""),  # where the last export went (empty: Documents)
    # Settings ▸ KV disk cache (app.link.disk_tier): full pages kept on disk, so a reopened chat is not read again
    Setting("kv_disk/enabled", bool, True),
    Setting("kv_disk/folder", str, ""),  # empty: the data folder's kv/
    Setting("kv_disk/budget_gib", float, 4.0),
    # Settings ▸ Quantized copies (app.link.copies): a folder's 8-bit / 4-bit blocks kept, the next load maps them
    Setting("quant_copies/enabled", bool, True),
    Setting("quant_copies/folder", str, ""),  # empty: the engine's default ($XDG_CACHE_HOME/kvscope/quantized)
    Setting("quant_copies/budget_gib", float, 16.0),
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
        """The value saved under ``key``, else its declared default — a copy where it is a list or a dict: a caller
        that edits what it got (``ModelDefaults.save``) must not change the default every later store hands out."""
        setting = _BY_KEY[key]  # KeyError for undeclared keys, on purpose
        value = _decode(setting, self._q.value(key))
        return copy.deepcopy(value) if value is setting.default and isinstance(value, (list, dict)) else value

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
