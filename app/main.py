"""Entry point: ``kvscope [--model DIR|HUB_ID|stories260K|demo] [--self-test] [--screenshot FILE]
[--data-dir DIR]``.

Shows the window first and loads the model afterwards on the worker thread (torch is imported there), so
the window is visible quickly.
"""

from __future__ import annotations

import time

_T_IMPORT = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvscope", description="Chat with a local LLM and watch its KV cache.")
    p.add_argument("--model", default=None, help="model folder, hub id, 'stories260K' (built in) or 'demo' "
                   "(random weights); default: the last one used, at first launch stories260K")
    p.add_argument("--self-test", action="store_true", help="run the GUI self-test offscreen and exit 0/1")
    p.add_argument("--screenshot", default=None, metavar="FILE", help="with --self-test: save the window as FILE at 1280x720 and as FILE-1920x1080 at 1920x1080")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where settings and chat history live (default: $KVSCOPE_DATA_DIR or the platform data dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, t0: float | None = None) -> int:
    t0 = _T_IMPORT if t0 is None else t0
    args = parse_args(argv)
    if args.self_test and "QT_QPA_PLATFORM" not in os.environ:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"

    # The GUI thread and the engine's worker share the GIL. At CPython's default 5 ms switch interval each
    # Python callback inside a paint can wait up to 5 ms for the worker to yield; at 1 ms the event loop
    # stays responsive (self-test event-loop p95 13-15 ms against 17-20 ms at 5 ms, on 2 cores).
    sys.setswitchinterval(0.001)
    from PySide6.QtCore import QCoreApplication, QTimer
    from PySide6.QtWidgets import QApplication

    QCoreApplication.setOrganizationName("kvscope")
    QCoreApplication.setApplicationName("kvscope")
    app = QApplication.instance() or QApplication(sys.argv[:1])

    from app.settings.store import default_data_dir
    from app.ground.theme import apply_theme

    apply_theme(app)
    from app.shell.resources import app_icon

    app.setWindowIcon(app_icon())
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()

    if args.self_test:
        from app.selftest.run import run_self_test

        code = run_self_test(app, model=args.model or "demo", screenshot=args.screenshot, t0=t0,
                             data_dir=Path(args.data_dir) if args.data_dir else None)
        _exit_now(code)

    from app.history.store import HistoryStore
    from app.shell.window import MainWindow
    from app.settings.store import Settings

    settings = Settings.from_data_dir(data_dir)
    history = HistoryStore.in_data_dir(data_dir)
    window = MainWindow(settings, history, model=args.model)
    window.show()
    QTimer.singleShot(0, window.start)
    code = run_window(app, window, history)
    _exit_now(code)
    return code


def run_window(app, window, history) -> int:
    """The event loop until the window closes, or SIGTERM / SIGINT quit it the same way (``app.shell.quit_signals``),
    then the worker joined (a running reply saved as stopped) and the history closed. The loop's exit code."""
    from app.shell.quit_signals import QuitOnSignals

    signals = QuitOnSignals(app)
    try:
        code = app.exec()
    finally:
        signals.uninstall()
    window.shutdown()  # joins the worker (or gives up after 2 s inside a long model load)
    history.close()
    return code


def _exit_now(code: int) -> None:
    """Leave without tearing down Qt and torch objects in interpreter-finalization order.

    Everything worth keeping is saved by then (settings synced, history closed). Letting Python finalize
    PySide6 widgets, pyqtgraph items and a worker that may still be inside a model load can crash at exit,
    which would turn a clean quit (or a passing self-test) into a non-zero exit status.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
