"""The rotated precisions (tq4 / tq3 / tq2, QJL keys) in the real window: named with tooltips in the precision lists,
on the model card, and a chat under them whose Memory readout holds the engine's formula's bytes, exactly."""

from __future__ import annotations

from app_helpers import close_window, open_window, use_lossy, wait_reply

from app.controls.cache_parts import TOOLTIP_ROLE
from app.ground.format import human_bytes
from engine.config import K_DTYPES, KV_DTYPES, SamplingConfig
from engine.kv.paged import sizes


def _items(box) -> dict[str, tuple[str, str]]:
    return {box.itemData(i): (box.itemText(i), box.itemData(i, TOOLTIP_ROLE)) for i in range(box.count())}


def test_precision_lists_name_the_rotated_kinds_and_a_chat_shows_their_bytes(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    c = w.controls
    try:
        keys, values = _items(c.k_dtype), _items(c.v_dtype)
        assert list(keys) == list(K_DTYPES) and list(values) == list(KV_DTYPES)  # QJL: keys only
        assert [keys[k][0] for k in ("tq4", "tq3", "tq2", "tq3-qjl")] == [
            "4-bit rotated (tq4)", "3-bit rotated (tq3)", "2-bit rotated (tq2)", "3-bit rotated + QJL"]
        assert all("Memory" in tip and "Quality" in tip for _, tip in keys.values())
        assert "0.20 of 16-bit at head size 64" in values["tq3"][1] and "QJL" in keys["tq2-qjl"][1]
        info = w.info
        per = {kind: info.num_layers * sum(sizes.bytes_per_token(kind, r, info.num_kv_heads, info.head_dim, 16)
                                           for r in "kv") for kind in ("tq4", "tq3", "tq2")}
        card = w.model_card.table.text()
        assert all(f"{kind} {human_bytes(per[kind])}" in card for kind in per), card

        c.k_dtype.setCurrentIndex(c.k_dtype.findData("tq3-qjl"))  # as the user does
        c.v_dtype.setCurrentIndex(c.v_dtype.findData("tq2"))
        said = use_lossy(qtbot, w)  # below 8 bits: it says what it costs here first
        assert said.startswith("Keys 3-bit rotated + QJL, values 2-bit rotated (tq2) lose information") and \
            "Not measured on stories260K yet" in said
        qtbot.waitUntil(lambda: (w.cache.applied.k_dtype, w.cache.applied.v_dtype) == ("tq3-qjl", "tq2"),
                        timeout=10_000)
        w.send("Once upon a time")
        assert wait_reply(qtbot, w)[1] == "max_tokens"
        qtbot.waitUntil(lambda: "keys 3-bit rotated + QJL · values 2-bit rotated" in w.status.cache.text())
        qtbot.waitUntil(lambda: w.memory.last_snapshot is not None and w.memory.last_snapshot.kv_bytes > 0)
        snap = w.memory.last_snapshot
        n = int(snap.tokens_per_layer.max())
        full, fill = divmod(n, 16)
        tail = 16 * info.num_kv_heads * info.head_dim * 4 if fill else 0  # the page being filled: float32
        want = info.num_layers * sum(full * 16 * sizes.bytes_per_token(kind, r, info.num_kv_heads, info.head_dim, 16)
                                     + tail for r, kind in (("k", "tq3-qjl"), ("v", "tq2")))
        assert snap.kv_bytes == want and w.memory.series()["kv_mib"][-1] * 2 ** 20 == want  # the Memory readout
    finally:
        close_window(w)
