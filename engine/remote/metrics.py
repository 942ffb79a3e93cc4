"""The ``vllm:`` facts of a Prometheus ``/metrics`` page that a cache view uses.

The page comes from a server we do not control (``engine.remote.guard`` caps it at 8 MiB): only the handful of
names below are parsed, sums are kept instead of sample lists, label values that are not plain numbers read as
0 and values that are not finite as 0, so an 8 MiB page of two million samples costs what its text costs. A
number too large for a pool (``num_gpu_blocks`` of 3x10^8) is kept as it is: the view refuses it with one line
(``engine.remote.view.check_shape``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the second: vLLM before 0.10
COUNTER_NAMES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total")
INFO_NAME = "vllm:cache_config_info"
WANTED = (*USAGE_NAMES, *COUNTER_NAMES, INFO_NAME)
HUGE = 10 ** 18  # a label number of more digits than this (it is refused later, by its size)
MAX_INFO_LABELS = 64  # vllm:cache_config_info has ~20


@dataclass(frozen=True)
class Metrics:
    """The ``vllm:`` facts of ``/metrics`` a cache view uses (0 where the server does not say)."""
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    block_size: int = 0
    num_blocks: int = 0
    cache_info: dict = field(default_factory=dict)  # every label of ``vllm:cache_config_info`` (printable text)
    engines: int = 0  # ``vllm:cache_config_info`` samples: one per engine (data-parallel rank)


def _labels(rest: str) -> dict:
    labels = {}
    for part in rest.rstrip("}").split('",')[:MAX_INFO_LABELS]:
        k, eq, v = part.partition('="')
        if eq:
            labels[k.strip(",")] = "".join(c if c.isprintable() else "?" for c in v.rstrip('"')[:200])
    return labels


def parse_prometheus(text: str, names: tuple[str, ...] | None = None):
    """(name, labels, value) of each sample line of a Prometheus text page (only ``names``, when given), lazily;
    a value that is not a finite number reads as 0.0."""
    pos, n = 0, len(text)
    while pos < n:
        end = text.find("\n", pos)
        end = n if end < 0 else end
        line, pos = text[pos:end].strip(), end + 1
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        if names is not None and name not in names:
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        yield name, _labels(rest) if rest else {}, number if math.isfinite(number) else 0.0


def label_int(value) -> int:
    """A label's count: plain ASCII digits, else 0 (``None``, ``"abc"``); more digits than 18: ``HUGE``."""
    value = str(value or "").strip()
    if not (value.isascii() and value.isdigit()):
        return 0
    return int(value) if len(value) <= 18 else HUGE


def metrics_of(text: str) -> Metrics:
    """The cache facts of a ``/metrics`` page; several engines (data-parallel ranks): usage averaged, counters
    summed, blocks summed."""
    sums = dict.fromkeys(WANTED, 0.0)
    counts = dict.fromkeys(WANTED, 0)
    info: dict = {}
    blocks = 0
    for name, labels, value in parse_prometheus(text, WANTED):
        sums[name] += value
        counts[name] += 1
        if name == INFO_NAME:
            info = labels
            blocks = min(HUGE, blocks + label_int(labels.get("num_gpu_blocks")))
    usage_name = next((u for u in USAGE_NAMES if counts[u]), USAGE_NAMES[0])
    usage = sums[usage_name] / counts[usage_name] if counts[usage_name] else 0.0

    def total(name: str) -> float:  # a counter of 2 million huge samples sums to inf: shown as at most 10^15
        return min(1e15, max(0.0, sums[name]))

    return Metrics(min(1.0, max(0.0, usage)), total("vllm:prefix_cache_queries_total"),
                   total("vllm:prefix_cache_hits_total"), total("vllm:num_preemptions_total"),
                   label_int(info.get("block_size")), blocks, info, counts[INFO_NAME])
