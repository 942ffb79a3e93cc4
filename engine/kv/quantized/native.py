"""Native kernels: C source built once with the machine's C compiler, cached, loaded with ctypes (``Native``). Two
sources use it: the quantized cache's fused attention (``TQ``, ``library()``) and the batched linears
(``engine.model.linear_kernel``).

Built on first use (a few hundred ms: one small file, no torch headers) into
``$XDG_CACHE_HOME/kvscope/native/<name>-<hash>.so``; the hash covers the source, the flags, the compiler and the CPU (the
code is built for this CPU), so a cached library is never loaded on a machine it was not built for. No compiler, a
failed build or ``KVSCOPE_NATIVE=off``: ``library()`` is None, said once in the log, and every caller keeps its
torch path (the same results up to summation order).
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
import tempfile
import threading
from pathlib import Path

from engine.kv.quantized import plain_kernel, tq_kernel

log = logging.getLogger(__name__)
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno")
TUNE = ("-march=native",)  # dropped when the compiler refuses it (Apple clang on arm64 before 15)
BUILD_TIMEOUT_S = 60


def enabled() -> bool:
    return os.environ.get("KVSCOPE_NATIVE", "on") != "off"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "native"


def _cpu() -> str:
    """What the build is tuned to: the CPU's model and flags (Linux), else the platform's words for it."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def compile_run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a compiler, its output captured; past ``timeout`` seconds the compiler and the programs it started are
    stopped (``cc`` runs ``cc1`` and ``as`` as children: killing the driver alone left them compiling) and
    ``subprocess.TimeoutExpired`` is raised."""
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


class Native:
    """One C source built once per machine into a cached library (``name-<hash>.so``), loaded with ctypes and its
    functions declared by ``declare``; ``what`` names, in the one log line, what runs on torch without it. The
    fused tq attention is one (``library()`` here); the batched linears of ``engine.model.linear_kernel`` another."""

    def __init__(self, name: str, source: str, declare, what: str) -> None:
        self.name, self.source, self.declare, self.what = name, source, declare, what
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._why: str | None = None  # why there is no library (None: there is one, or nobody asked yet)

    def _build(self, cc: str, tune: tuple[str, ...], target: Path) -> None:
        """Compile into a temporary folder beside ``target`` and rename the library into place: a rename is atomic
        only within one file system (a /tmp on tmpfs and a home on disk: EXDEV), and a concurrent build of the same
        hash then only replaces one whole file with another."""
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
            src = Path(tmp) / f"{self.name}.c"
            src.write_text(self.source, encoding="utf-8")  # UTF-8 comments, whatever the locale (ASCII on some)
            out = Path(tmp) / f"{self.name}.so"
            r = compile_run([cc, *FLAGS, *tune, "-o", str(out), str(src), "-lm"], BUILD_TIMEOUT_S)
            if r.returncode != 0:
                last = (r.stderr or r.stdout).strip().splitlines()
                raise RuntimeError(f"{Path(cc).name} failed: {last[-1] if last else 'exit status ' + str(r.returncode)}")
            os.replace(out, target)

    def load(self, tune: tuple[str, ...] = TUNE) -> ctypes.CDLL:
        """The library built with ``tune`` (``()``: for any CPU of this architecture), from the cache or built now.
        Raises RuntimeError / OSError when that cannot be done."""
        cc = _compiler()
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
        target = self.cached_path(cc, tune)
        if not target.exists():
            self._build(cc, tune, target)
        try:
            lib = ctypes.CDLL(str(target))
        except OSError:  # a cached file that does not load (cut short by a full disk, copied in): built again, once
            target.unlink(missing_ok=True)
            self._build(cc, tune, target)
            lib = ctypes.CDLL(str(target))
        return self.declare(lib)

    def cached_path(self, cc: str, tune: tuple[str, ...] = TUNE) -> Path:
        """Where the library built by ``cc`` with ``tune`` for this CPU is kept."""
        key = hashlib.sha256("\0".join((self.source, *FLAGS, *tune, cc, _cpu())).encode()).hexdigest()[:20]
        return cache_dir() / f"{self.name}-{key}.so"

    def library(self) -> ctypes.CDLL | None:
        """The loaded library, built for this CPU the first time (portable where the compiler refuses that); None,
        said once in the log and in ``why()``, where it cannot be."""
        if not enabled():
            return None
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            for tune in (TUNE, ()):
                try:
                    self._lib, self._why = self.load(tune), None
                    break
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    self._why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            if self._lib is None:
                log.warning("native kernels for %s are off, the torch path runs instead (%s)", self.what, self._why)
            self._tried = True
        return self._lib

    def why(self) -> str | None:
        """Why ``library()`` is None (after it was asked), else None."""
        return "KVSCOPE_NATIVE=off" if not enabled() else self._why


class Role(ctypes.Structure):
    """``kvs_role`` of the kernel source: one role's pages of one layer."""

    _fields_ = [("codes", ctypes.c_void_p), ("head_stride", ctypes.c_int64), ("row_bytes", ctypes.c_int),
                ("bits", ctypes.c_int), ("dim", ctypes.c_int), ("width", ctypes.c_int), ("norms", ctypes.c_void_p),
                ("levels", ctypes.c_void_p), ("table", ctypes.c_void_p), ("tail", ctypes.c_void_p),
                ("signs", ctypes.c_void_p), ("sign_head_stride", ctypes.c_int64), ("sign_row_bytes", ctypes.c_int),
                ("sign_norms", ctypes.c_void_p), ("sign_levels", ctypes.c_void_p), ("sign_table", ctypes.c_void_p),
                ("mode", ctypes.c_int), ("page_size", ctypes.c_int), ("group", ctypes.c_int),
                ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64, role = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(Role)
    fn = lib.kvs_tq_decode
    fn.restype = i
    fn.argtypes = [i, i, p, i64, i64, role, role, p, p]  # hk rep q n nt keys values scratch out
    fn = lib.kvs_plain_decode
    fn.restype = i
    # h0 h1 rep n dk dv bf16 kp k_head vp v_head slots q nk nv scale out
    fn.argtypes = [i, i, i, i64, i, i, i, p, i64, p, i64, p, p, p, p, ctypes.c_float, p]
    return lib


# kvs_tq_decode with the KV heads shared among torch's threads, set once ``engine.model.linear_op`` has loaded its
# C++ library (ctypes function: hk rep q n nt keys values out width dv); None until then
PARALLEL_TQ = None
SOURCE = tq_kernel.SOURCE + plain_kernel.SOURCE  # the fused decode attention over quantized pages, then plain ones
TQ = Native("kernels", SOURCE, _declare, "the fused decode attention")


def library() -> ctypes.CDLL | None:
    """The fused tq attention's kernels (``Native.library``)."""
    return TQ.library()


def load(tune: tuple[str, ...] = TUNE) -> ctypes.CDLL:
    return TQ.load(tune)


def cached_path(cc: str, tune: tuple[str, ...] = TUNE) -> Path:
    return TQ.cached_path(cc, tune)


def why() -> str | None:
    return TQ.why()
