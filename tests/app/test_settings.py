"""Settings are declared once and stored in an INI file built from a temp path."""

from __future__ import annotations

import pytest

from app.settings.store import SETTINGS, Settings


def test_defaults_and_round_trip(tmp_path):
    path = tmp_path / "s.ini"
    s = Settings.from_file(path)
    for setting in SETTINGS:
        assert s.get(setting.key) == setting.default
    s.set("cache/mode", "contiguous")
    s.set("cache/page_size", 32)
    s.set("cache/prefix_reuse", False)
    s.set("sampling/temperature", 0.25)
    s.set("cache/policy_params", {"sinks": 4, "window": 64})
    s.set("window/state", b"\x00\x01binary")
    s.add_recent_model("/models/a")
    s.add_recent_model("/models/b")
    s.add_recent_model("/models/a")
    s.sync()
    t = Settings.from_file(path)
    assert t.get("cache/mode") == "contiguous"
    assert t.get("cache/page_size") == 32
    assert t.get("cache/prefix_reuse") is False
    assert t.get("sampling/temperature") == 0.25
    assert t.get("cache/policy_params") == {"sinks": 4, "window": 64}
    assert t.get("window/state") == b"\x00\x01binary"
    assert t.get("model/recent") == ["/models/a", "/models/b"]
    assert path.read_text().startswith("[")  # INI format


def test_unknown_key_is_an_error(tmp_path):
    s = Settings.from_file(tmp_path / "s.ini")
    with pytest.raises(KeyError):
        s.get("cache/nope")
    with pytest.raises(KeyError):
        s.set("nope", 1)


def test_garbage_values_fall_back_to_defaults(tmp_path):
    path = tmp_path / "s.ini"
    path.write_text("[cache]\npage_size=banana\npolicy_params={not json\n[sampling]\ntemperature=hot\n")
    s = Settings.from_file(path)
    assert s.get("cache/page_size") == 16
    assert s.get("cache/policy_params") == {}
    assert s.get("sampling/temperature") == 0.7


def test_data_dir_env_override(tmp_path, monkeypatch):
    from app.settings.store import default_data_dir

    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path / "x"))
    assert default_data_dir() == tmp_path / "x"
