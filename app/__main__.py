"""``python -m app`` runs the desktop app (same as the ``kvscope`` console script)."""

import time

_T0 = time.perf_counter()

from app.main import main  # noqa: E402

raise SystemExit(main(t0=_T0))
