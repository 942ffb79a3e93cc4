"""Cache-policy controls: built from each policy's Params dataclass; changes emit a CacheConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from PySide6.QtWidgets import QLineEdit, QSpinBox

from app.controls import policies
from app.controls.cache_controls import CacheControls
from engine.config import CacheConfig


@dataclass(frozen=True)
class _Params:
    sinks: int = field(default=4, metadata={"min": 0, "max": 64, "help": "kept first tokens"})
    window: int = 256
    ratio: float = 0.5
    keep_system: bool = True
    pinned: tuple = (0, 8)


class _FakePolicy:
    """A test policy."""

    label = "Fake policy for tests"
    Params = _Params


def test_policies_come_from_the_engine_registry():
    names = policies.policy_names()
    assert names[0] == "none"
    assert {"streaming", "h2o", "priority"} <= set(names)
    fields = {f.name for f in policies.policy_params("streaming")}
    assert fields == {"sinks", "window"}


def test_params_form_is_built_from_the_dataclass(qtbot, monkeypatch):
    monkeypatch.setattr(policies, "_registry", lambda: {"fake": _FakePolicy})
    c = CacheControls(CacheConfig())
    qtbot.addWidget(c)
    assert [c.policy.itemData(i) for i in range(c.policy.count())] == ["none", "fake"]
    with qtbot.waitSignal(c.changed, timeout=2000) as blocker:
        c.policy.setCurrentIndex(1)
    cfg = blocker.args[0]
    assert cfg.policy == "fake"
    assert cfg.policy_params == {"sinks": 4, "window": 256, "ratio": 0.5, "keep_system": True, "pinned": (0, 8)}
    sinks = c.findChild(QSpinBox, "param_sinks")
    assert (sinks.minimum(), sinks.maximum()) == (0, 64) and sinks.toolTip().startswith("kept first tokens")
    assert c.policy_help.text() == "Fake policy for tests"
    with qtbot.waitSignal(c.changed, timeout=2000) as blocker:
        sinks.setValue(8)
    assert blocker.args[0].policy_params["sinks"] == 8
    pinned = c.findChild(QLineEdit, "param_pinned")
    pinned.setText("2, 5, 9")
    pinned.editingFinished.emit()
    qtbot.waitUntil(lambda: c.config().policy_params["pinned"] == (2, 5, 9), timeout=2000)
    assert dataclasses.is_dataclass(_Params)


def test_controls_round_trip_and_mode_enables(qtbot):
    cfg = CacheConfig(mode="contiguous", page_size=32, prefix_reuse=False, k_dtype="int8", v_dtype="int4",
                      overflow="rolling")
    c = CacheControls(cfg)
    qtbot.addWidget(c)
    assert c.config() == cfg
    assert not c.page_size.isEnabled()  # page size only matters for paged
    with qtbot.waitSignal(c.changed, timeout=2000) as blocker:
        c.mode.setCurrentIndex(c.mode.findData("paged"))
    assert blocker.args[0].mode == "paged" and c.page_size.isEnabled()
    with qtbot.waitSignal(c.changed, timeout=2000) as blocker:
        c.mode.setCurrentIndex(c.mode.findData("off"))
    assert not c.k_dtype.isEnabled() and not c.policy.isEnabled()
    with qtbot.assertNotEmitted(c.changed, wait=300):
        c.set_config(CacheConfig())  # showing a config is not a change
