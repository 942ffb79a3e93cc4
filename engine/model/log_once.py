"""A library's log message that repeats on every call, shown once.

bitsandbytes logs "MatMul8bitLt: inputs will be cast from torch.float32 to float16 during quantization" on
every 8-bit matmul whose input is not float16 (always on a CPU, where the engine computes in float32): a
4-token ``generate --quantize int8`` of the 5-layer stories260K printed it 175 times. Once says the same.
"""

from __future__ import annotations

import logging

MAX_REMEMBERED = 256  # distinct messages kept; past that a message may show again (memory stays bounded)


class OncePerMessage(logging.Filter):
    """Lets each distinct formatted message through once."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text in self._seen:
            return False
        if len(self._seen) >= MAX_REMEMBERED:
            self._seen.clear()
        self._seen.add(text)
        return True


def once_per_message(logger_name: str) -> None:
    """Install ``OncePerMessage`` on the named logger (a filter on a logger sees only its own records, so the
    logger that calls ``warning`` is named, not a parent); calling it again adds nothing."""
    log = logging.getLogger(logger_name)
    if not any(isinstance(f, OncePerMessage) for f in log.filters):
        log.addFilter(OncePerMessage())
