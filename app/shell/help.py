"""Help ▸ What am I seeing?: a short text and a colour legend per panel, and the keyboard shortcuts.

Small non-modal dialogs (not a web page), opened from each panel's "?" button and from the Help menu.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QScrollArea, QVBoxLayout, QWidget

from app.panels import memory, occupancy, page_map, strip, timing
from app.ground.reuse_words import REASONS
from engine import snapshot as S


@dataclass(frozen=True)
class PanelHelp:
    """What one panel shows: a few sentences and (colour, meaning) pairs."""

    title: str
    text: str
    legend: tuple[tuple[str, str], ...] = ()


PANEL_HELP = {
    "OccupancyPanel": PanelHelp(
        "Layer occupancy",
        "One bar per layer of the model: how many tokens that layer keeps in the KV cache right now. The dashed "
        "line is how many it has room for. Bars are flat across layers unless an eviction policy drops "
        "different tokens per layer (H2O), or the model has sliding-window or state layers. The caption counts "
        "tokens the cache dropped (evicted) and the token just generated, which the next step caches.",
        tuple((c, n) for n, c in occupancy.SEGMENTS) + (("#e0e0e0", "capacity (dashed line)"),)),
    "PageMapPanel": PanelHelp(
        "Page map",
        "Every square is one page of the paged cache (page size tokens each), in page-id order. Pages of the "
        "chat are coloured by the turn that wrote them and are brighter the fuller they are; shared pages "
        "belong to more than one chat (or to a regenerated reply). The strip on top is the chat's tokens from "
        "first to last: which are kept, kept as attention sinks, quantized, pinned, or evicted. Hover a page "
        "for its details. Only the paged cache has pages. With speculative decoding the model checks several guessed "
        "tokens in one pass: it writes a slot for each of them at once (framed in amber: the pages those slots "
        "took), keeps the guesses it agrees with and cuts the others back at once — the line under the legend says "
        "how many slots were written and how many were cut back. A draft model keeps its own small cache: its pages are "
        "drawn after the model's (the caption says which are which). With the KV disk cache on (Settings ▸ KV disk cache), a "
        "chat reopened after a restart takes its full pages from files instead of reading the chat again: those pages are "
        "framed in pink (restored from disk) and the line under the legend counts them. When this turn's prompt "
        "computed tokens the cache had held (the prompt changed, a window passed, no checkpoint there…), the strip "
        "splits in two: its lower half colours those tokens by the reason (hover one for the details; View ▸ Why "
        "were tokens recomputed? lists them). On a model with sliding-window or recurrent layers, white ticks on "
        "the strip are checkpoints: the points a later prompt (a regenerate, a branch, an edit) can go back to — "
        "a snapshot of the recurrent state and the window's pages there; hover one for its bytes. Pages only "
        "checkpoints hold are drawn pale violet.",
        ((page_map.TURN_COLOURS[0], "page in use (colour = turn)"),
         (page_map.VERIFY_COLOUR, "frame: written by a check of guessed tokens (speculative decoding)"),
         (page_map.RESTORED_COLOUR, "frame: restored from disk (its K/V read from the KV disk cache)"))
        + tuple((page_map.STATE_COLOURS[c], S.PAGE_STATE_NAMES[c]) for c in page_map.STATE_COLOURS
                if c != S.PAGE_ACTIVE)
        + tuple((page_map.TOKEN_COLOURS[c], "token " + S.TOKEN_STATE_NAMES[c]) for c in page_map.TOKEN_COLOURS)
        + tuple(strip.reason_chips())
        + ((strip.CHECKPOINT_PAGE_COLOUR, "page only checkpoints hold (a sliding window kept for going back)"),)),
    "RemotePageMap": PanelHelp(  # the page map while a remote chat is on screen (PageMapPanel.set_legend_mode)
        "Page map (remote chat)",
        "A remote chat is on screen: every square is one block of the server's KV cache (block size tokens each), "
        "as the server's KV events tell it. Blocks of this chat (its prompt and replies, matched block by block from "
        "the first) take the first turn's colour; blocks of other requests, and blocks the server keeps in its "
        "prefix cache for a prompt that starts alike, are muted; a block the server evicted is red for 2 seconds. "
        "The events name only full blocks, and not where they sit in the server's memory: each is drawn in the "
        "lowest free square, and a block still being written is not drawn (the caption's KV usage, from the "
        "server's /metrics, counts it). The strip on top is this chat's tokens: those in its cached blocks, and "
        "the rest. The caption says how full the pool is; the line under the legend the prefix cache's hit rate.",
        tuple((c, t) for c, t in page_map.REMOTE_PAGES)
        + tuple((c, "token " + t) for c, t in page_map.REMOTE_STRIP)),
    "TimingPanel": PanelHelp(
        "Token timing",
        "Left: the time to read the prompt before the first token (prefill, TTFT), for this reply and the "
        "previous one. Right, top: milliseconds per generated token; bottom: tokens per second over the last "
        f"{timing.ROLLING} tokens. With a cache the time per token stays flat; with the cache off it grows with "
        "every token, because the whole chat is recomputed. The previous reply is dashed, so you can compare "
        "settings. When the reply used speculative decoding, the line under the charts says how many tokens each "
        "pass of the model gave on average, and how often a guessed token was kept at each place of a guess "
        "(the first guessed token is kept most often; each later one only if all before it were).",
        ((timing.PREFILL, "prefill of this reply"), (timing.PREVIOUS, "previous reply (dashed)"),
         (timing.CURRENT, "ms per token"), ("#43c59e", "tokens per second"))),
    "MemoryPanel": PanelHelp(
        "Memory",
        "The bar compares the model's weights with the KV cache, to scale. The chart shows both over time on a "
        "log scale (each grid line is 10× the one below). The KV cache grows with the chat; quantization, "
        "eviction and smaller pages make it smaller. Time while the chat is idle is drawn flat.",
        ((memory.WEIGHTS_COLOUR, "weights"), (memory.KV_COLOUR, "KV cache"),
         (memory.DEVICE_COLOUR, "device memory in use (CUDA only)"))),
    "ModelCardPanel": PanelHelp(
        "Model card",
        "Facts about the loaded model: its layers, how many key/value heads its attention has (MHA: one per "
        "query head; GQA: shared by groups; MQA: one), and so how many bytes each token costs in the KV cache. "
        "The chart shows the KV memory at the full context as loaded, and what it would be as MHA or MQA. "
        "\"reuse\" says where a later prompt can go back to on this model: anywhere with full attention only; "
        "with sliding-window or recurrent layers only to checkpoints (turn starts and each prompt's end), and "
        "what each costs."),
    "WhyPanel": PanelHelp(
        "Why recomputed?",
        "The last prompt of the chat on screen, token range by range: which tokens were computed instead of read "
        "from the cache, and why — new (never cached), the prompt changed (the message where it first differs, "
        "and the text before and after), evicted (for room or by the eviction policy), in a partly filled page, a "
        "setting changed, a sliding window passed, no checkpoint of a recurrent layer there, a page file on disk "
        "lost, or the cache off. The prompt's last token is always computed: its logits give the reply's first "
        "token. A reply's footer says the first reason in one line; its \"Why?\" brings this readout forward.",
        tuple((strip.REASON_COLOURS[r], label) for r, (label, _) in REASONS.items())),
}

SHORTCUTS = (
    ("Enter or Ctrl+Enter", "send the message"),
    ("Shift+Enter", "new line in the message"),
    ("Esc", "stop the reply"),
    ("Tab / Shift+Tab", "move to the next / previous control on screen (arrow keys on a dock's tab bar bring "
                        "the dock behind it forward)"),
    ("Ctrl+N", "new chat"),
    ("Ctrl+M", "choose a model"),
    ("Ctrl+O", "open a model folder"),
    ("Ctrl+K", "compare cache settings on this chat"),
    ("Ctrl+R", "regenerate the last reply"),
    ("Ctrl+L", "move to the message box"),
    ("Ctrl+,", "settings (server, speculation, KV disk cache, new chats)"),
    ("F1", "what am I seeing? (help for every panel)"),
    ("Ctrl+Q", "quit"),
)


def legend_html(legend: tuple[tuple[str, str], ...]) -> str:
    rows = "".join(f"<tr><td style='color:{c}; font-size:15px; padding-right:6px'>■</td><td>{t}</td></tr>"
                   for c, t in legend)
    return f"<table cellspacing='0' cellpadding='1'>{rows}</table>" if legend else ""


def help_html(entry: PanelHelp) -> str:
    return f"<p>{entry.text}</p>" + legend_html(entry.legend)


def _dialog(parent: QWidget | None, title: str, html: str, name: str) -> QDialog:
    dlg = QDialog(parent)
    dlg.setObjectName(name)
    dlg.setWindowTitle(title)
    dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    body = QLabel(html)
    body.setObjectName("helpText")
    body.setWordWrap(True)
    body.setTextFormat(Qt.TextFormat.RichText)
    body.setContentsMargins(8, 8, 8, 8)
    scroll = QScrollArea()  # long help scrolls: the dialog fits a 720-pixel screen
    scroll.setWidgetResizable(True)
    scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    scroll.setWidget(body)
    buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
    buttons.rejected.connect(dlg.close)
    layout = QVBoxLayout(dlg)
    layout.addWidget(scroll, 1)
    layout.addWidget(buttons)
    dlg.resize(520, min(560, body.heightForWidth(500) + 80))
    return dlg


def show_panel_help(panel: QWidget) -> QDialog:
    """The "What am I seeing?" dialog of one panel (non-modal)."""
    key = getattr(panel, "help_key", "") or panel.objectName()  # the page map's own while a remote chat is shown
    entry = PANEL_HELP.get(key, PanelHelp(panel.objectName(), ""))
    dlg = _dialog(panel.window(), f"What am I seeing? — {entry.title}", help_html(entry), "panelHelp")
    dlg.show()
    return dlg


def show_all_help(parent: QWidget) -> QDialog:
    """Every panel's help in one dialog (Help ▸ What am I seeing?)."""
    html = "".join(f"<h3>{e.title}</h3>" + help_html(e) for e in PANEL_HELP.values())
    dlg = _dialog(parent, "What am I seeing?", html, "panelHelp")
    dlg.show()
    return dlg


def show_shortcuts(parent: QWidget) -> QDialog:
    rows = "".join(f"<tr><td style='padding-right:14px'><b>{k}</b></td><td>{v}</td></tr>" for k, v in SHORTCUTS)
    dlg = _dialog(parent, "Keyboard shortcuts", f"<table cellspacing='0' cellpadding='2'>{rows}</table>",
                  "shortcutsHelp")
    dlg.show()
    return dlg
