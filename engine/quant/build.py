"""The one build path of the GGUF block kernels: the C sources in ``engine/quant/csrc`` compiled into one shared
library, loaded with ctypes (``KERNELS.library()``).

Where the library comes from, first found wins:

1. ``KVSCOPE_QUANT_LIB``: a library file named by the user (a build of their own);
2. a prebuilt library shipped beside the sources (``engine/quant/prebuilt/kq-<level>.so``, made by
   ``python -m engine.quant.build --prebuild DIR`` when the installers are built: one per x86 level, the best
   this CPU runs is taken), so a machine without a compiler runs the kernels;
3. built here at first use with the machine's C compiler for this CPU (``-march=native``), ~3 s once, cached in
   ``$XDG_CACHE_HOME/kvscope/native/kq-<hash>.so`` (the hash covers the sources, flags, compiler and CPU, so a
   cached library never runs on a machine it was not built for).

Why at first use rather than at install time: the engine runs from a source checkout with no install step, and
the kernels are tuned to the CPU they run on (AVX-512 VNNI here, AVX2 elsewhere); the installers ship the
prebuilt levels for machines without a compiler. Nothing found: ``library()`` is None, said once in the log, and
GGUF weights are dequantized on load as before (the reason is on the model card).

OpenMP: built with ``-fopenmp`` where the compiler takes it; the library then uses the libgomp torch has loaded
(the same soname), so its threads are torch's pool. Without it (Apple clang) the products run on one thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
PREBUILT = Path(__file__).parent / "prebuilt"
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno", "-std=gnu11")
TIMEOUT_S = 120
# x86 levels the installers prebuild: (name, compiler flags, /proc/cpuinfo flags the CPU needs)
LEVELS = (
    ("avx512vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mf16c", "-mfma"),
     ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c")),
    ("avx2", ("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi2")),
    ("generic", (), ()),
)


def enabled() -> bool:
    """``KVSCOPE_NATIVE=off`` turns every native kernel off (the same switch as the KV cache's kernels)."""
    return os.environ.get("KVSCOPE_NATIVE", "on") != "off"


def cache_dir() -> Path:
    """The native kernels' cache folder (shared with the KV cache's: ``$XDG_CACHE_HOME/kvscope/native``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "native"


def compile_run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a compiler, its output captured; past ``timeout`` seconds the compiler and the programs it started
    (``cc`` runs ``cc1`` and ``as`` as children) are stopped and ``subprocess.TimeoutExpired`` is raised."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=os.name == "posix")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if os.name == "posix":
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def sources() -> tuple[Path, ...]:
    """The C files compiled into the library (headers are hashed with them)."""
    return tuple(sorted(CSRC.glob("*.c")))


def _source_key() -> str:
    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*.[ch]")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_key() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        keep = {ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")}
        return "\n".join(sorted(keep))
    except OSError:
        return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def compile_library(cc: str, tune: tuple[str, ...], out: Path, openmp: bool = True) -> None:
    """Compile the sources with ``tune`` into ``out`` (written beside it, then renamed: atomic on one file system).
    Raises RuntimeError with the compiler's last line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        cmd = [cc, *FLAGS, *tune, *(("-fopenmp",) if openmp else ()), "-I", str(CSRC), "-o", str(lib),
               *map(str, sources()), "-lm"]
        r = compile_run(cmd, TIMEOUT_S)
        if r.returncode != 0:
            last = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cc).name} failed: {last[-1] if last else 'exit status ' + str(r.returncode)}")
        os.replace(lib, out)


def cached_path(cc: str, tune: tuple[str, ...], openmp: bool) -> Path:
    key = hashlib.sha256("\0".join((_source_key(), *FLAGS, *tune, str(openmp), cc, _cpu_key())).encode())
    return cache_dir() / f"kq-{key.hexdigest()[:20]}.so"


def prebuilt_for_cpu() -> Path | None:
    """The best prebuilt library this CPU runs (None: none shipped, or not an x86 Linux machine)."""
    if not PREBUILT.is_dir() or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = _cpu_flags()
    for name, _, need in LEVELS:
        path = PREBUILT / f"kq-{name}.so"
        if path.is_file() and all(f in flags for f in need):
            return path
    return None


class Kernels:
    """The library, found or built once per process (``library()``); ``why()`` says why there is none."""

    def __init__(self, declare) -> None:
        self.declare = declare
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._why: str | None = None
        self.origin = ""  # where the loaded library came from, in words

    def _find(self) -> tuple[ctypes.CDLL, str]:
        named = os.environ.get("KVSCOPE_QUANT_LIB", "").strip()
        if named:
            return ctypes.CDLL(named), f"{named} (KVSCOPE_QUANT_LIB)"
        pre = prebuilt_for_cpu()
        if pre is not None:
            return ctypes.CDLL(str(pre)), f"prebuilt {pre.name}"
        cc = _compiler()
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc or clang) on PATH and no prebuilt library")
        errors = []
        for tune in (("-march=native",), ()):
            for openmp in (True, False):
                target = cached_path(cc, tune, openmp)
                try:
                    if not target.exists():
                        compile_library(cc, tune, target, openmp)
                    return ctypes.CDLL(str(target)), f"built for this CPU ({' '.join(tune) or 'portable'})"
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    target.unlink(missing_ok=True)
                    errors.append(str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        raise RuntimeError(errors[0])

    def library(self) -> ctypes.CDLL | None:
        if not enabled():
            return None
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                try:
                    lib, origin = self._find()
                    self._lib, self.origin = self.declare(lib), origin
                except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                    self._why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    log.warning("GGUF block kernels are off: quantized GGUF weights are dequantized on load (%s)",
                                self._why)
                self._tried = True
        return self._lib

    def why(self) -> str | None:
        return "KVSCOPE_NATIVE=off" if not enabled() else self._why


def prebuild(out_dir: Path) -> list[Path]:
    """Build every x86 level into ``out_dir`` (the installers' step; needs a C compiler that knows the levels)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    made = []
    for name, tune, _ in LEVELS:
        out = out_dir / f"kq-{name}.so"
        compile_library(cc, tune, out)
        made.append(out)
    return made


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--prebuild":
        for p in prebuild(Path(sys.argv[2])):
            print(p)
    else:
        print("usage: python -m engine.quant.build --prebuild DIR", file=sys.stderr)
        sys.exit(2)
