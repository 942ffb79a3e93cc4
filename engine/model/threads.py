"""How many CPU threads torch uses for a model, chosen per model size and machine load.

Measured on this project's 2-core machine with other work running (tok/s, 1 thread vs 2):
stories260K 224-239 vs 20-32, the 0.8M demo model 241-265 vs 13-19, SmolLM2-135M 7.1-7.2 vs 1.0-1.5.
Small models are per-op overhead, which threads only add to (OpenMP wakes and syncs them ~900 times per
token); a busy core makes every thread wait for the slowest. So: one thread below ``SMALL_PARAMS``, else
the cores the machine has idle, and never more than it has. ``OMP_NUM_THREADS`` / ``KVSCOPE_THREADS`` win.

"Idle" is measured over the load itself, without this process: the CPU time every core spent on other programs'
normal-priority work (``busy_elsewhere``). The one-minute load average, used before, counts this process's own
recent work: on a 2-core machine a load right after a reply (load ~1.0) took one thread, and a 1B Q4_K_M decoded
at 36 tok/s instead of 46 on two. Niced work (the compiled step's build child, indexers) yields to ours and is
not counted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

SMALL_PARAMS = 50_000_000  # below this a model's step is op overhead, not arithmetic


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Sample:
    """CPU seconds so far: ``busy`` every core's at normal priority (user, system, interrupts, stolen by the
    host), ``own`` this process's (user + system), at ``at`` (``time.monotonic``)."""

    at: float
    busy: float
    own: float


def sample() -> Sample | None:
    """The machine's and this process's CPU time now (psutil: /proc on Linux, the kernel's counters elsewhere);
    None where they cannot be read."""
    try:
        import psutil

        t, p = psutil.cpu_times(), psutil.Process().cpu_times()
    except Exception:  # noqa: BLE001 - no psutil, or a platform that hides the counters
        return None
    busy = sum(getattr(t, f, 0.0) for f in ("user", "system", "irq", "softirq", "steal", "interrupt", "dpc"))
    return Sample(time.monotonic(), busy, p.user + p.system)


def busy_elsewhere(since: Sample | None = None, window: float = 0.1) -> float | None:
    """Cores busy with other programs' normal-priority work since ``since`` (a load's start), or over ``window``
    seconds from now; None where the counters cannot be read. The counters tick every 10 ms, so a window is at
    least ``window`` long: one tick of another program over a 20 ms load would read as half a core busy, over
    0.1 s it is 0.1 core. A load shorter than that waits out the rest (a 1B Q4_K_M maps in ~0.1 s here)."""
    if since is None:
        since = sample()
        if since is None:
            return None
    short = window - (time.monotonic() - since.at)
    if short > 0:
        time.sleep(short)
    now = sample()
    if now is None or now.at - since.at <= 0:
        return None
    return max(0.0, (now.busy - since.busy) - (now.own - since.own)) / (now.at - since.at)


def choose(num_params: int, device_type: str, since: Sample | None = None) -> tuple[int, str]:
    """(threads, why in words) for a model of ``num_params`` parameters running on ``device_type``; ``since``: a
    ``sample`` from the load's start (the window other programs' work is measured over)."""
    for var in ("KVSCOPE_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), f"{value} ({var})"
    n = cores()
    if device_type != "cpu":
        return torch.get_num_threads(), f"{torch.get_num_threads()} (the model runs on {device_type})"
    if num_params < SMALL_PARAMS:
        return 1, f"1 (a model under {SMALL_PARAMS // 1_000_000}M parameters: threads only add overhead)"
    busy = busy_elsewhere(since)
    if busy is None:  # no counters: the load average (which counts this process too)
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
        idle = max(1, min(n, int(n - load + 0.5)))
        return idle, f"{idle} of {n} cores (load {load:.1f})"
    idle = max(1, min(n, int(n - busy + 0.5)))
    others = f"{busy:.1f} cores busy with other programs" if busy >= 0.05 else "none busy with other programs"
    return idle, f"{idle} of {n} cores ({others} as it loaded)"


def physical_cores() -> int:
    """Physical cores among those this process may run on (hyper-threads of one core counted once; Linux reads
    the topology from /sys, elsewhere every logical CPU counts)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return cores()
    seen = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "core_id") as f, open(base + "physical_package_id") as g:
                seen.add((g.read().strip(), f.read().strip()))
        except OSError:
            seen.add(("cpu", str(cpu)))
    return max(1, len(seen))


def for_server(num_params: int, device_type: str) -> tuple[int, str]:
    """(threads, why) for ``engine serve``: a server has no window to keep responsive and owns the machine, so as
    vLLM's CPU backend does it takes every physical core (not only those idle at load time, the app's rule), one
    thread each; a model under ``SMALL_PARAMS`` keeps one thread (measured: stories260K 224-239 tok/s on one,
    20-32 on two). ``KVSCOPE_THREADS`` / ``OMP_NUM_THREADS`` win."""
    for var in ("KVSCOPE_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), f"{value} ({var})"
    if device_type != "cpu":
        return torch.get_num_threads(), f"{torch.get_num_threads()} (the model runs on {device_type})"
    if num_params < SMALL_PARAMS:
        return 1, f"1 (a model under {SMALL_PARAMS // 1_000_000}M parameters: threads only add overhead)"
    n = physical_cores()
    return n, f"{n} (every physical core: a server)"


def apply(threads: int) -> None:
    """Use ``threads`` for torch's CPU work from now on (process-wide; cheap when unchanged)."""
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def cpu_features() -> str:
    """What this CPU offers the model's arithmetic, in words: torch's vector level and native bf16 (AMX /
    AVX512-BF16, from /proc/cpuinfo on Linux). Native bf16 is where loading a model in bfloat16 pays: half the
    weight bytes and hardware dot products (this project's 2-core machine: AVX512, AMX-BF16)."""
    try:
        level = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - an old torch: no level to report
        level = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    bf16 = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    parts = [f"{level} vector units"] if level else []
    parts.append(f"native bf16 ({', '.join(bf16)})" if bf16 else ("no native bf16" if flags else ""))
    return " · ".join(p for p in parts if p)
