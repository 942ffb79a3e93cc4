"""Cache-policy controls: mode, page size, prefix reuse, K/V precision, eviction policy with a form built
from the policy's ``Params`` dataclass, and context-overflow behaviour.

Every change emits ``changed(CacheConfig)`` (spin boxes are debounced), and the window forwards it to the
worker, which applies it between decode steps, also in the middle of a reply.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.ground import glossary
from app.controls import policies
from app.controls.cache_parts import (
    TIP_ROLE,
    TOOLTIP_ROLE,
    AskStrip,
    PageSizeBox,
    PolicyParamsForm,
    enable,
    fill_combo,
    follow_tip,
    offer,
)
from app.controls.lossy import lossy_parts
from app.ground.glossary import CONTROLS
from app.ground.widgets import DebouncedForm
from engine.config import CACHE_MODES, FALLBACK, K_DTYPES, KV_DTYPES, MAX_PAGE_SIZE, OVERFLOWS, CacheConfig


class CacheControls(DebouncedForm, QWidget):
    """The cache-policy form. ``config()`` is the current ``CacheConfig``; ``set_config`` shows one.
    ``default_requested``: "Make default for new chats" was pressed; ``model_default_requested``: "... for this
    model"."""

    changed = Signal(object)
    default_requested = Signal()
    model_default_requested = Signal()  # "Make default for this model"

    def __init__(self, config: CacheConfig | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("CacheControls")
        self._building = False
        self._init_debounce()

        self.mode = QComboBox()
        fill_combo(self.mode, CACHE_MODES, glossary.MODES, "mode")
        self.page_size = PageSizeBox()
        self.page_size.setRange(1, MAX_PAGE_SIZE)
        self.page_size.setSuffix(" tokens")
        self.page_size.setToolTip(CONTROLS["page_size"].tip)
        self.prefix_reuse = QCheckBox(CONTROLS["prefix_reuse"].name)
        self.prefix_reuse.setToolTip(CONTROLS["prefix_reuse"].tip)
        self.k_dtype = QComboBox()
        self.v_dtype = QComboBox()
        fill_combo(self.k_dtype, K_DTYPES, glossary.KV_DTYPES, "k_dtype")  # keys also take the QJL kinds
        fill_combo(self.v_dtype, KV_DTYPES, glossary.KV_DTYPES, "v_dtype")
        self.policy = QComboBox()
        self.policy.setProperty("control", "policy")
        self.policy.currentIndexChanged.connect(lambda _i: follow_tip(self.policy))
        self.params = PolicyParamsForm()
        self.policy_help = QLabel("")
        self.policy_help.setWordWrap(True)
        self.policy_help.setObjectName("hint")
        self.overflow = QComboBox()
        fill_combo(self.overflow, OVERFLOWS, glossary.OVERFLOWS, "overflow")
        for box in (self.mode, self.k_dtype, self.v_dtype, self.policy, self.overflow):
            # As wide as the longest name: a name is never cut (the dock is at least this wide).
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.notes = QLabel("")
        self.notes.setWordWrap(True)
        self.notes.setObjectName("hint")
        self.asking_strip = AskStrip()
        self.scope = QLabel("These settings belong to this chat.")
        self.scope.setObjectName("hint")
        self.scope.setWordWrap(True)
        self.default_button, self.model_default_button = self._default_buttons()
        self.lossy_line = QLabel("")
        self.lossy_line.setObjectName("noteLine")
        self.lossy_line.setWordWrap(True)
        self.lossy_line.setVisible(False)

        # the choices whose items depend on the rest (``CacheConfig.need``), and what the user last chose in each:
        # a choice the cache mode or the policy forced back (``_fit``) returns when it can apply again
        self._choices = {"k_dtype": self.k_dtype, "v_dtype": self.v_dtype, "policy": self.policy,
                         "overflow": self.overflow}
        self._wanted: dict[str, Any] = {}
        self._kept_params: tuple[str, dict] = ("none", {})  # the policy _fit turned off, with its parameters
        self._chat = (0, 0)  # the chat on screen's tokens and the model's context (``set_chat_length``)

        self._lay_out()
        self.refresh_policies()
        self.set_config(config or CacheConfig())
        self._connect()

    def _default_buttons(self) -> tuple[QPushButton, QPushButton]:
        """'Make default for new chats' and '... for this model'."""
        everyone = QPushButton("Make default for new chats")
        everyone.setToolTip("New chats start with these cache settings and this chat's speculative decoding (each "
                            "chat keeps its own: opening a chat puts its settings back in force)")
        everyone.clicked.connect(self.default_requested)
        model = QPushButton("Make default for this model")
        model.setToolTip("New chats of the loaded model start with these settings, before the defaults for new "
                         "chats (\"Make default for new chats\" forgets them)")
        model.clicked.connect(self.model_default_requested)
        return everyone, model

    def _lay_out(self) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        cache_box = QGroupBox("Cache")
        form = QFormLayout(cache_box)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        form.addRow(CONTROLS["mode"].name, self.mode)
        form.addRow(CONTROLS["page_size"].name, self.page_size)
        form.addRow(self.prefix_reuse)
        form.addRow(CONTROLS["k_dtype"].name, self.k_dtype)
        form.addRow(CONTROLS["v_dtype"].name, self.v_dtype)
        layout.addWidget(cache_box)
        policy_box = QGroupBox("Eviction and overflow")
        pform = QVBoxLayout(policy_box)
        pform.addWidget(QLabel(CONTROLS["policy"].name))
        pform.addWidget(self.policy)
        pform.addWidget(self.policy_help)
        pform.addWidget(self.params)
        pform.addWidget(QLabel(CONTROLS["overflow"].name))
        pform.addWidget(self.overflow)
        layout.addWidget(policy_box)
        layout.addWidget(self.asking_strip)
        layout.addWidget(self.lossy_line)
        layout.addWidget(self.notes)
        layout.addWidget(self.scope)
        # under the words, one above the other: beside the words they squeezed them to four lines at 1280 px, side
        # by side they widened the dock past the chat at 1024 px
        for button in (self.default_button, self.model_default_button):
            row = QHBoxLayout()
            row.addWidget(button)
            row.addStretch(1)
            layout.addLayout(row)
        layout.addStretch(1)

    def _connect(self) -> None:
        self.mode.currentIndexChanged.connect(self._on_mode)
        self.page_size.valueChanged.connect(self._later)
        self.prefix_reuse.toggled.connect(self._now)
        for name in ("k_dtype", "v_dtype", "overflow"):
            self._choices[name].currentIndexChanged.connect(lambda _i, n=name: self._picked(n))
        self.policy.currentIndexChanged.connect(self._on_policy)
        self.params.edited.connect(self._later)

    def refresh_policies(self) -> None:
        current = self.policy.currentData()
        self._building = True
        self.policy.clear()
        for name in policies.policy_names():
            self.policy.addItem(glossary.name_of(glossary.POLICIES, name), name)
            self.policy.setItemData(self.policy.count() - 1, policies.policy_tip(name), TOOLTIP_ROLE)
            self.policy.setItemData(self.policy.count() - 1, policies.policy_tip(name), TIP_ROLE)
        idx = self.policy.findData(current) if current else 0
        self.policy.setCurrentIndex(max(idx, 0))
        follow_tip(self.policy)
        self._building = False

    @property
    def pending(self) -> bool:
        """A change the user made is waiting to be sent (debounced)."""
        return self._debounce.isActive()

    def set_config(self, cfg: CacheConfig) -> None:
        """Show ``cfg`` without emitting ``changed``."""
        self._building = True
        try:
            self.mode.setCurrentIndex(max(self.mode.findData(cfg.mode), 0))
            self.page_size.setValue(cfg.page_size)
            self.prefix_reuse.setChecked(cfg.prefix_reuse)
            self.k_dtype.setCurrentIndex(max(self.k_dtype.findData(cfg.k_dtype), 0))
            self.v_dtype.setCurrentIndex(max(self.v_dtype.findData(cfg.v_dtype), 0))
            if self.policy.findData(cfg.policy) < 0:
                self.policy.addItem(glossary.name_of(glossary.POLICIES, cfg.policy), cfg.policy)
            self.policy.setCurrentIndex(self.policy.findData(cfg.policy))
            self.params.build(cfg.policy, cfg.policy_params)
            self.policy_help.setText(policies.policy_summary(cfg.policy))
            self.overflow.setCurrentIndex(max(self.overflow.findData(cfg.overflow), 0))
            self._wanted = {name: getattr(cfg, name) for name in self._choices}
            self._sync_enabled()
        finally:
            self._building = False

    def config(self) -> CacheConfig:
        return CacheConfig(
            mode=self.mode.currentData(),
            page_size=self.page_size.value(),
            prefix_reuse=self.prefix_reuse.isChecked(),
            k_dtype=self.k_dtype.currentData(),
            v_dtype=self.v_dtype.currentData(),
            policy=self.policy.currentData() or "none",
            policy_params=self.params.values(),
            overflow=self.overflow.currentData(),
        )

    def show_notes(self, notes: list[str]) -> None:
        self.notes.setText("\n".join(f"• {n}" for n in notes))

    # -- a question about the change chosen (``app.controls.cache_controller``) --------------------------------
    @property
    def asking(self) -> bool:
        return self.asking_strip.isVisibleTo(self) or self.asking_strip.holding

    def ask(self, text: str, yes: str, on_yes, on_no) -> None:
        """Hold the change shown: ``text`` and a button ``yes`` (``on_yes``) or Cancel (``on_no``)."""
        self.asking_strip.ask(text, yes, on_yes, on_no)

    def clear_ask(self) -> None:
        self.asking_strip.clear()

    def show_lossy(self, cfg: CacheConfig) -> None:
        """The setting in force loses information: said under the controls while it is on."""
        parts = lossy_parts(cfg)
        self.lossy_line.setText(("Lossy: " + ", ".join(parts) + " — replies may differ from the full cache's")
                                if parts else "")
        self.lossy_line.setVisible(bool(parts))

    def set_chat_length(self, tokens: int, context: int) -> None:
        """The chat on screen's tokens (every one so far) and the model's context: with the cache off each step
        reads the whole chat, which a chat as long as the context cannot be (the engine refuses it)."""
        if (tokens, context) != self._chat:
            self._chat = (tokens, context)
            self._sync_enabled()

    def _sync_enabled(self) -> None:
        """Grey out what cannot apply with the rest as shown, the reason first in its tooltip (``glossary.NEEDS``):
        nothing the engine would refuse can be chosen."""
        mode = self.mode.currentData()
        cfg = self.config()
        cached = mode != "off"
        tokens, ctx = self._chat
        long = cached and 0 < ctx <= tokens  # the engine's refusal: cache off takes no chat as long as the context
        offer(self.mode, {self.mode.findData("off"): glossary.off_too_long(tokens, ctx)} if long else {})
        enable(self.page_size, mode == "paged", glossary.NEEDS["pages"], CONTROLS["page_size"].tip)
        enable(self.prefix_reuse, cached, glossary.NEEDS["cache"], CONTROLS["prefix_reuse"].tip)
        self.params.setEnabled(cached)
        for name, box in self._choices.items():
            offer(box, {i: glossary.NEEDS[need] for i in range(box.count())
                        if (need := cfg.unmet(name, box.itemData(i))) is not None})
            if name != "overflow":  # nothing of these applies to a cache that is off ("Stop the reply" does)
                enable(box, cached, glossary.NEEDS["cache"], box.toolTip())

    def _fit(self) -> None:
        """After the cache mode or the policy changed: a choice the rest no longer allows falls back (``FALLBACK``:
        full precision, keep everything, stop the reply), and one the user made that is allowed again returns."""
        was = self._building
        self._building = True
        try:
            for name in FALLBACK:  # in order: the policy before the overflow, whose "policy" choice needs one
                box, cfg = self._choices[name], self.config()
                current, wanted = box.currentData(), self._wanted.get(name, box.currentData())
                if wanted != current and cfg.unmet(name) is None and \
                        lossy_parts(cfg.replace(**{name: wanted})) != lossy_parts(cfg):
                    self._wanted[name] = current  # lossy: it comes back only when chosen again, never by itself
                    continue
                value = wanted if cfg.unmet(name, wanted) is None else FALLBACK[name] if cfg.unmet(name) else current
                if value == current or box.findData(value) < 0:
                    continue
                if name == "policy" and value == "none":
                    self._kept_params = (current, self.params.values())
                box.setCurrentIndex(box.findData(value))
                if name == "policy":
                    kept, params = self._kept_params
                    self.params.build(value, params if kept == value else None)
                    self.policy_help.setText(policies.policy_summary(value))
        finally:
            self._building = was

    def _picked(self, name: str) -> None:
        """The user chose in the combo ``name``: remembered (``_fit`` brings it back), and sent."""
        if self._building:
            return
        self._wanted[name] = self._choices[name].currentData()
        self._now()

    def _on_mode(self) -> None:
        if not self._building:
            self._fit()
        self._sync_enabled()
        self._now()

    def _on_policy(self) -> None:
        if self._building:
            return
        name = self.policy.currentData() or "none"
        self._wanted["policy"] = name
        self.params.build(name)
        self.policy_help.setText(policies.policy_summary(name))
        self._fit()
        self._sync_enabled()
        self._now()

    def _emit(self) -> None:
        try:
            cfg = self.config()
        except ValueError as exc:
            self.show_notes([str(exc)])
            return
        self.changed.emit(cfg)


