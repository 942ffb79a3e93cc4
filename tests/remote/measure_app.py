"""Event → page map latency in the real window: ``QT_QPA_PLATFORM=offscreen python tests/remote/measure_app.py
--server vllm|kvscope --json out.json``. The window is attached to the server (File ▸ Connect to a server…'s
code path) with its remote chat on screen while 4 other clients (another process) stream requests; every redraw that shows a new
batch records the time from that batch's server timestamp to the drawing (``RemoteChats.draw_delays``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import subprocess
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vllm_env as env  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--server", choices=("vllm", "kvscope"), default="vllm")
    p.add_argument("--json", required=True)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    from PySide6.QtWidgets import QApplication

    app = QApplication([])
    from app.history.store import HistoryStore
    from app.shell.window import MainWindow
    from app.remote.chat import RemoteChats
    from app.selftest.run import wait_until
    from app.settings.store import Settings
    from engine.remote.client import RemoteClient

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-measure-app-"))
    model = env.make_model(tmp / "model")
    port, ev = env.free_port(), env.free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}", "topic": "kv-events"}
    start = env.start_vllm if a.server == "vllm" else env.start_kvscope
    proc = start(*((env.ensure_venv(print),) if a.server == "vllm" else ()), model, port, events, tmp / "server.log")
    url = f"http://127.0.0.1:{port}"
    w = None
    try:
        env.wait_ready(url, proc, 400, tmp / "server.log")
        w = MainWindow(Settings.from_data_dir(tmp / "data"), HistoryStore.in_data_dir(tmp / "data"),
                       model="resources/models/stories260K")
        w.resize(1280, 720)
        w.show()
        w.start()
        wait_until(lambda: w.info is not None, 120)
        remote = RemoteChats.of(w)
        dialog = remote.open_dialog()
        dialog.url.setText(url)
        dialog.connect_button.click()
        wait_until(lambda: remote.current is not None, 60)
        name = RemoteClient(url).models()[0]
        here = Path(__file__).resolve().parent
        for r in range(a.rounds):  # the 4 other clients are another process, as other users are
            clients = subprocess.Popen([sys.executable, "-c", f"import measure; measure.load({url!r}, {name!r}, 4, 64, "
                                        f"{r})"], cwd=here)
            wait_until(lambda: clients.poll() is not None, 300)  # the GUI loop runs meanwhile
            wait_until(lambda: False, 0.3)
        d = sorted(remote.redraw.delays)
        pct = (lambda q: round(d[min(len(d) - 1, int(q * len(d)))] * 1e3, 1)) if d else (lambda q: None)
        arrival = sorted(remote.current.link.engine.view.latencies)
        out = {"server": a.server, "draws": len(d), "p50_ms": pct(0.5), "p95_ms": pct(0.95), "max_ms": pct(1.0),
               "arrival_p50_ms": round(arrival[len(arrival) // 2] * 1e3, 1) if arrival else None,
               "arrival_p95_ms": round(arrival[int(0.95 * (len(arrival) - 1))] * 1e3, 1) if arrival else None}
        print(json.dumps(out), flush=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    finally:
        if w is not None:
            w.shutdown()
            w.close()
        env.stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
