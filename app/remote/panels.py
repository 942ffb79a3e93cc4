"""The panels while a remote chat is on screen: the page map draws the server's block pool from its KV events
(``engine.remote.view.RemoteView``), the timing panel the reply's streamed chunks, and the controls that the
server fixed when it started are read-only with the server's values.

The view's slots become page-map states so the map's own colours, legend and hover apply unchanged: this chat's
blocks are active (its turn colour), other requests' cached (the muted prefix-cache colour), evicted blocks red for
a moment. Every block an event names is full (vLLM publishes only full blocks), so each cell is drawn full; a
block being written is not in the events and so not on the map (occupancy from ``/metrics`` counts it).
"""

from __future__ import annotations

import html

import numpy as np
from PySide6.QtWidgets import QLabel, QWidget

from app.ground.docks import on_screen
from app.remote.chat_list import MARK, measured_speed
from engine import snapshot as S
from engine.remote.view import SLOT_CHAT, SLOT_EVICTED, SLOT_FREE, SLOT_OTHER, malformed_text
from engine.snapshot import CacheSnapshot, TokenEvent

SLOT_STATES = {SLOT_FREE: S.PAGE_FREE, SLOT_CHAT: S.PAGE_ACTIVE, SLOT_OTHER: S.PAGE_CACHED,
               SLOT_EVICTED: S.PAGE_EVICTED}
MIN_SHOWN = 256  # blocks the map draws at least (a pool that small is drawn whole)
SHOWN_STEP = 128  # the drawn part grows in steps, so the grid does not reflow with every block
TIMING_TIP = ("A remote reply's timing as this client measured it, network included: the first bar is the wait for "
              "the first token (TTFT), the curves the gaps between streamed chunks")
TIMING_IDLE = ("Timing of this chat's replies as this client measures them (the network included): the wait for the "
               "first token, then the gaps between streamed chunks.")
OTHER_PANELS = "A remote chat is on screen: its server's cache is in the Page map."  # short: captions wrap in full


def shown_slots(slots) -> np.ndarray:
    """The part of a pool the map draws: up to the last block held (or just evicted), rounded up, at least
    ``MIN_SHOWN``. The view gives each new block the lowest free slot, so what is held sits at the start, and a
    server's pool of thousands of blocks would otherwise draw a few cells too small to see."""
    a = np.asarray(slots, dtype=np.int64)
    used = np.flatnonzero(a != SLOT_FREE)
    last = int(used[-1]) + 1 if len(used) else 0
    return a[: min(len(a), max(MIN_SHOWN, -(-last // SHOWN_STEP) * SHOWN_STEP))]


def cache_snapshot(pools: list, chat_tokens: int, generation: int = 0, account=None) -> CacheSnapshot:
    """The remote pools (one per engine rank, side by side; each cut by ``shown_slots``) as a ``CacheSnapshot``
    the page map draws; ``account``: why the last prompt was recomputed (``engine.remote.why``: the token strip's
    reasons, the Why recomputed? readout)."""
    parts = [shown_slots(p.slots) for p in pools]
    slots = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    table = np.array([SLOT_STATES[i] for i in range(len(SLOT_STATES))], dtype=np.int8)
    state = table[np.clip(slots, 0, len(table) - 1)] if len(slots) else np.zeros(0, np.int8)
    block = max((p.block_size for p in pools), default=0) or 16
    held = (state == S.PAGE_ACTIVE) | (state == S.PAGE_CACHED)
    chat_blocks = sum(p.chat_blocks for p in pools)
    tokens = np.full(chat_tokens, S.TOKEN_NOT_CACHED, dtype=np.int8)
    tokens[: min(chat_blocks * block, chat_tokens)] = S.TOKEN_KEPT  # the chat's tokens in full blocks
    n = len(state)
    groups = tuple((f"engine {p.rank}", len(part)) for p, part in zip(pools, parts)) if len(pools) > 1 else ()
    return CacheSnapshot(
        generation_id=generation, step=0, mode="paged", policy="server", page_size=block, num_pages=n,
        pages_used_per_layer=np.zeros(0, int), tokens_per_layer=np.zeros(0, int), bytes_per_layer=np.zeros(0, int),
        capacity_tokens=n * block, page_state=state, page_owner=np.where(state == S.PAGE_ACTIVE, 0, -1),
        page_fill=np.where(held, block, 0), page_refcount=held.astype(np.int32), token_state=tokens,
        weights_bytes=0, kv_bytes=0, device_bytes=0, reused_tokens=0, recomputed_tokens=0, first_divergence=-1,
        seq_len=chat_tokens, context_length=0, page_groups=groups, page_mine=state == S.PAGE_ACTIVE, account=account)


def pool_texts(pools: list, metrics, cached_tokens: int | None, server: str, malformed: int = 0) -> tuple[str, str]:
    """The page map's caption (the pool: short, it wraps in full) and readout line (the counters: one line, in
    full in its tooltip) for a remote pool, from its events and ``/metrics``; ``malformed``: events the view
    skipped (``RemoteView.malformed``)."""
    block = max((p.block_size for p in pools), default=0) or metrics.block_size
    num = sum(p.num_blocks for p in pools) or metrics.num_blocks
    cached = sum(p.cached_blocks for p in pools)
    mine = sum(p.chat_blocks for p in pools)
    gaps, resyncs = sum(p.gaps for p in pools), sum(p.resyncs for p in pools)
    caption = (f"<b>{html.escape(server)}</b> · block size {block} · <b>{cached}</b>/{num} blocks cached · "
               f"this chat <b>{mine}</b> · KV usage {metrics.kv_usage:.1%}")
    shown = sum(len(shown_slots(p.slots)) for p in pools)
    if shown < max(num, sum(len(p.slots) for p in pools)):
        caption += f" · drawn: the first {shown} blocks (the rest are free)"
    if len(pools) > 1:
        caption += f" · {len(pools)} engines, one pool each"
    hit = (f"{metrics.prefix_hits / metrics.prefix_queries:.0%} ({metrics.prefix_hits:,.0f} of "
           f"{metrics.prefix_queries:,.0f} tokens)") if metrics.prefix_queries else "—"
    parts = [f"prefix cache hit rate {hit}"]
    if cached_tokens is not None:
        parts.append(f"last reply {cached_tokens:,} cached tokens")
    parts.append(f"{metrics.preemptions:,.0f} preemptions")
    parts.append(f"events: {gaps} batch{'es' if gaps != 1 else ''} missed, "
                 f"{resyncs} resync{'s' if resyncs != 1 else ''}")
    if malformed:
        parts.append(malformed_text(malformed))
    return caption, " · ".join(parts)


def occupancy_text(metrics) -> str:
    """The Layer occupancy caption while a remote chat is shown: the server reports one usage figure for its whole
    pool (every layer's blocks are allocated together), so there are no per-layer bars to draw."""
    used = f"<b>{metrics.kv_usage:.1%}</b> of {metrics.num_blocks:,} blocks" if metrics.num_blocks else \
        f"<b>{metrics.kv_usage:.1%}</b>"
    return (f"Server KV cache in use: {used} (vllm:kv_cache_usage_perc, all layers together: a block holds every "
            "layer's keys and values). The blocks themselves are in the Page map.")


def timing_text(reply) -> str:
    """The timing caption of a remote reply: TTFT and decode speed as this client measured them (network in)."""
    ttft = f"TTFT {reply.ttft_s * 1e3:.0f} ms" if reply.ttft_s is not None else "no token"
    gaps = np.diff(np.asarray(reply.token_times)) * 1e3 if len(reply.token_times) > 1 else np.zeros(0)
    n = max(len(reply.token_ids), len(reply.token_times))
    speed = measured_speed(reply)
    if speed is None:
        return f"<b>remote reply</b> · {ttft} ({len(reply.prompt_ids)} prompt tokens) · {n} tokens in one burst"
    together = sum(reply.together(i) for i in range(1, len(reply.token_times)))
    if together * 2 > len(gaps):  # most came with the one before: their gaps are the way's buffering, not the server's
        itl = f" · {together} of {len(gaps)} arrived together with the one before (buffered on the way)"
    else:
        itl = f" · inter-token p50 {np.median(gaps):.1f} ms" if len(gaps) else ""
    return (f"<b>remote reply</b> · {ttft} ({len(reply.prompt_ids)} prompt tokens) · {n} tokens at "
            f"<b>{speed:.1f} tok/s</b>{itl}")


def fixed_text(settings: dict) -> str:
    """'fixed by the server: block size 16, KV dtype auto — set when it was started'."""
    return (f"fixed by the server: block size {settings.get('block size', '?')}, KV dtype "
            f"{settings.get('KV dtype', '?')} — set when it was started")


def status_fields(rc) -> dict[str, tuple[str, str]]:
    """The status bar's fields (text, tooltip) for a connected remote chat on screen: its model and server, the
    server's fixed cache settings, the chat's tokens on the server and its last reply's speed — none of them the
    local model's or chat's."""
    eng = rc.link.engine
    info, m = eng.metrics.cache_info, eng.metrics
    block, num = m.block_size or info.get("block_size"), m.num_blocks
    prefix = {"true": "on", "false": "off"}.get(str(info.get("enable_prefix_caching", "")).lower())
    cache = [f"block size {block}" if block else "", f"{num:,} blocks" if num else "",
             f"prefix caching {prefix}" if prefix else ""]
    cache_text = "server cache: " + " · ".join(c for c in cache if c) if any(cache) else "server cache: —"
    reply = rc.reply
    usage = reply.usage if reply is not None else {}
    ids = rc.chain_ids  # the reply in flight's once its prompt is known, else the last reply's prompt + tokens
    tokens = len(ids) or int(usage.get("total_tokens") or 0)
    prompt = int(usage.get("prompt_tokens") or 0) or (len(reply.prompt_ids) if reply is not None else 0)
    made = int(usage.get("completion_tokens") or 0) or (len(reply.token_ids) if reply is not None else 0)
    so_far = " so far" if rc.generation and rc.live_prompt else ""
    speed = measured_speed(reply) if reply is not None and not reply.error else None
    url = eng.client.url
    return {
        "model": (f"{MARK} {rc.model} @ {rc.server}", f"A remote chat: {rc.model} answers from {url}"),
        "device": ("on the server", f"The model runs on {rc.server}: this window sends the chat, streams the "
                                    "replies and draws the server's KV events"),
        "cache": (cache_text, "Fixed by the server when it was started; the Cache policy panel's settings apply "
                              f"to local chats ({fixed_text(eng.fixed_settings())})"),
        "context": (f"Context: {tokens:,} tokens{so_far}" if tokens else "Context: —",
                    f"This chat's tokens on the server: its last reply's prompt ({prompt:,} tokens) and reply "
                    f"({made:,}), as the server counted them. The context limit is the server's."),
        "speed": (f"{speed:.1f} tokens/s" if speed else "", "Decode speed of this chat's last reply as this "
                                                            "client saw its chunks arrive (the network included)"),
    }


def chunk_events(generation: int, index: int, arrival: float, previous: float, n_ids: int,
                 together: bool = False) -> list[TokenEvent]:
    """A streamed chunk as the timing panel's tokens. The first chunk's time is the wait for it (TTFT); a later
    one's, the gap since the chunk before, shared by its tokens (the panel averages a group: the first token has
    ``tokens_in_step`` > 0, the others 0). A chunk that came ``together`` with the one before (the same read:
    buffered on the way) has no time of its own: its tokens join that chunk's group — drawn alone, each would be
    a ~0 ms token at tens of thousands of tok/s (vLLM's CPU stream does this)."""
    if index == 0:
        return [TokenEvent(generation, 0, -1, "", "prefill", max(arrival - previous, 0.0) * 1e3, 0)]
    n = max(n_ids, 1)
    first = 0 if together else 1
    ms = 0.0 if together else max(arrival - previous, 0.0) * 1e3
    return [TokenEvent(generation, index, -1, "", "decode", ms if i == 0 else 0.0, first if i == 0 else 0)
            for i in range(n)]


class ControlsLock:
    """Greys the local-only controls while a remote chat is shown (with the server's values and why) and gives
    them back as they were."""

    def __init__(self, window) -> None:
        self.window = window
        self.label = QLabel("")
        self.label.setObjectName("remoteFixed")
        self.label.setWordWrap(True)
        self.label.setVisible(False)
        window.controls.layout().insertWidget(0, self.label)  # above the groups, never greyed itself
        self._saved: list[tuple[QWidget, bool, str]] = []

    def _targets(self) -> list[QWidget]:
        out = []
        for box in (self.window.controls, self.window.spec_controls):
            out += [w for w in box.findChildren(QWidget) if w.parent() is box and w is not self.label]
        return out

    @property
    def locked(self) -> bool:
        return bool(self._saved)

    def lock(self, text: str) -> None:
        if not self.locked:
            self._saved = [(w, w.isEnabled(), w.toolTip()) for w in self._targets()]
            compare = self.window.menu_actions.get("compare")
            if compare is not None:
                self._saved.append((compare, compare.isEnabled(), compare.toolTip()))
        for w, _on, _tip in self._saved:
            w.setEnabled(False)
            w.setToolTip(text)
        self.label.setText(f"<b>Remote chat</b>: {html.escape(text)}. Cache mode, page size, precision and "
                           "policies apply to local chats.")
        self.label.setVisible(True)

    def unlock(self) -> None:
        for w, on, tip in self._saved:
            w.setEnabled(on)
            w.setToolTip(tip)
        self._saved = []
        self.label.setVisible(False)


class RemotePanels:
    """The panels a remote chat borrows: ``borrow`` when one comes on screen, ``draw`` it, ``give_back`` after."""

    def __init__(self, window) -> None:
        self.window = window
        self.lock = ControlsLock(window)
        self._front = None  # the dock in front of the page map's tabs before a remote chat came on screen
        self._timing_tip = ""  # the timing caption's tooltip (the compiled decode step's)

    def borrow(self) -> None:
        """A remote chat comes on screen: the panels and status bar it describes in its server's words are kept
        for ``give_back`` (the status bar's remote fields come with the first ``draw``)."""
        w = self.window
        w.page_map.set_legend_mode("remote")
        # until draw says which chat (a saved chat that is not connected is never drawn: the bar says this of it)
        w.status.show_remote({"model": (f"{MARK} a remote chat", "")})
        w.trace.reset()
        w.scheduler.clear()  # no local snapshot reaches the panels while no local chat is on screen
        w.why.clear()  # the remote chat's account comes with its first draw
        for panel in (w.occupancy, w.memory):
            panel.caption.setText(OTHER_PANELS)
        self._timing_tip = w.timing.caption.toolTip()
        w.timing.set_idle_text(TIMING_IDLE)  # not the local model's compiled decode step
        w.timing.caption.setToolTip(TIMING_TIP)
        dock = w.docks["page_map"]  # the remote view's panel comes to the front of its tabs
        self._front = next((d for d in [dock] + w.tabifiedDockWidgets(dock) if on_screen(d)), None)
        dock.raise_()

    def give_back(self) -> None:
        """The local chat (or an API conversation) is back: every panel and field as it was, local news in."""
        w = self.window
        self.lock.unlock()
        w.page_map.set_legend_mode("local")
        w.status.show_local()
        if self._front is not None and on_screen(w.docks["page_map"]):
            self._front.raise_()
        w.page_map.clear()
        w.why.clear()
        w.timing.set_idle_text("")
        w.timing.clear()
        w.timing.caption.setToolTip(self._timing_tip)

    def draw(self, rc, force: bool = False) -> None:
        """The page map from the view and the last ``/metrics``, the timing caption from the reply (panels behind
        another tab wait, and all of them while live panels are off, unless ``force``: a reply ended)."""
        w, eng = self.window, rc.link.engine
        w.status.show_remote(status_fields(rc))  # a few labels: even while the live panels are off
        if not (force or w.scheduler.enabled):  # View ▸ Live panels off: they pause (and say so), remote ones too
            return
        if force or on_screen(w.page_map):
            ids = rc.chain_ids
            pools = eng.view.snapshots(ids)
            account = rc.reply.cache if rc.reply is not None and not rc.generation else None  # the ids' own
            snap = cache_snapshot(pools, len(ids), rc.generation, account)
            w.page_map.show_snapshot(snap)
            if force or on_screen(w.why):
                w.why.show_snapshot(snap)
            cached = rc.reply.cached_tokens if rc.reply is not None and not rc.reply.error else None
            caption, readout = pool_texts(pools, eng.metrics, cached, f"{rc.model} @ {rc.server}", eng.view.malformed)
            if rc.link.error:  # what is drawn is the last the server said
                caption = f"<span style='color:#ff6b6b'>not answering</span> · {caption}"
                readout = f"{rc.link.error} (asking again in {rc.link.retry_in:.0f} s) · {readout}"
            w.page_map.caption.setText(caption)
            w.page_map.readout = readout
            if not w.page_map.hovering:  # the mouse on a page: its description stays
                w.page_map.hover.setText(readout)
        if force or on_screen(w.occupancy):
            w.occupancy.caption.setText(occupancy_text(eng.metrics))
        if force or on_screen(w.timing):
            w.timing.refresh()
            w.timing.caption.setToolTip(TIMING_TIP)
            if rc.generation:
                w.timing.caption.setText(f"<b>remote reply</b> · streaming: {rc.chunks} chunks so far")
            elif rc.reply is not None:
                w.timing.caption.setText(timing_text(rc.reply))
