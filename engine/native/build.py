"""The one build path of the native kernels: C / C++ source files (``engine/native/csrc``, ``engine/quant/csrc``)
compiled into shared libraries (``engine.native.libraries``: what each holds and what its absence costs), loaded with
ctypes (``Native.library()``).

Where a library comes from, first found wins:

1. a file the user names (``Library.env``, e.g. ``KVSCOPE_QUANT_LIB``): a build of their own;
2. a prebuilt library shipped beside the sources (``prebuilt/<name>-<level>.so``, one per x86 level, the best this CPU
   runs is taken; the torch operators: ``prebuilt/torch_ops-torch<version>.so``, for that torch only), made by
   ``python -m engine.native.build --prebuild`` when the installers and the wheel are built, so a machine without a
   compiler runs the kernels;
3. built here at first use with the machine's compiler for this CPU (``-march=native``, else portable), cached in
   ``$XDG_CACHE_HOME/kvscope/native/<name>-<hash>.so`` (the hash covers the sources, flags, compiler and CPU, so a
   cached library never runs on a machine it was not built for).

Why at first use rather than as a compiled extension at install time: the engine runs from a source checkout with no
install step, the kernels are tuned to the CPU they run on (AVX-512 BF16 / VNNI here, AVX2 elsewhere), and the torch
operators must match the torch they are loaded into, which a user may change after installing. The installers and
the wheel carry the prebuilt levels for machines without a compiler. Nothing found: ``library()`` is None, one line
in the log says which fast path is missing and what it costs, and the loader says it once to the user
(``missing_note``); every caller keeps its torch path.
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
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)
TIMEOUT_S = 300  # the torch operators: ~10-30 s on two busy cores; the C libraries: 1-10 s
TUNE = ("-march=native",)  # dropped when the compiler refuses it (Apple clang on arm64 before 15)
# x86 levels the installers prebuild, best first: (name, compiler flags, /proc/cpuinfo flags the CPU needs). The
# kernels switch on __AVX512BF16__ (bfloat16 products by pairs), AVX-512 VNNI (GGUF integer products), __AVX512F__,
# __AVX2__ / __FMA__ / __F16C__: each level turns on one more of those roads.
LEVELS = (
    ("avx512bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mf16c", "-mfma"),
     ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx2", "fma", "f16c")),
    ("avx512vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mf16c", "-mfma"),
     ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c")),
    ("avx2", ("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi2")),
    ("generic", (), ()),
)


@dataclass(frozen=True)
class Library:
    """One shared library: its sources (file names or globs in ``csrc``; headers there are hashed with them), the
    flags they are compiled with, where its prebuilt files live, and in words the fast path it is (``what``) and what
    runs without it (``cost``)."""

    name: str
    csrc: Path
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    prebuilt: Path
    env: str  # the variable naming a user's own build
    what: str
    cost: str
    cxx: bool = False  # C++ (CXX), else C (CC)
    torch: bool = False  # built against torch's headers and libraries: one build per torch version, not per CPU
    openmp: bool = False  # tried with -fopenmp first (the library then runs on the libgomp torch has loaded)

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.sources or not self.env.startswith("KVSCOPE_"):
            raise ValueError(f"library {self.name!r}: a name, sources and a KVSCOPE_ variable")

    def files(self) -> tuple[Path, ...]:
        """The source files compiled, in order (globs sorted)."""
        out: list[Path] = []
        for pattern in self.sources:
            out += sorted(self.csrc.glob(pattern)) if any(c in pattern for c in "*?[") else [self.csrc / pattern]
        return tuple(out)

    def source_key(self) -> str:
        """A hash of the sources and every header beside them."""
        h = hashlib.sha256(self.name.encode())
        for p in sorted({*self.files(), *self.csrc.glob("*.h")}):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        return h.hexdigest()


def enabled() -> bool:
    """``KVSCOPE_NATIVE=off`` turns every native kernel off (each caller keeps its torch path)."""
    return os.environ.get("KVSCOPE_NATIVE", "on") != "off"


def cache_dir() -> Path:
    """Where libraries built at first use are kept: ``$XDG_CACHE_HOME/kvscope/native``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "native"


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


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_key() -> str:
    """What a build is tuned to: the CPU's model and flags (Linux), else the platform's words for it."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        keep = {ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")}
        return "\n".join(sorted(keep))
    except OSError:
        return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def compiler(cxx: bool) -> str | None:
    """The C (``CC``) or C++ (``CXX``) compiler a build runs, None where there is none."""
    if cxx:
        return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def torch_version() -> str:
    """The running torch's version: the operators' prebuilt file and cache key name it (their ABI is that torch's)."""
    import torch

    return torch.__version__


def _torch_args() -> list[str]:
    """The compiler arguments that build against the running torch (its headers: not in the installers' bundle,
    which carries the operators prebuilt)."""
    import torch
    from torch.utils import cpp_extension

    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            *[f"-I{p}" for p in cpp_extension.include_paths()], *[f"-L{p}" for p in cpp_extension.library_paths()],
            "-lc10", "-ltorch_cpu", "-ltorch"]  # torch's libraries are loaded before this one: found by their names


def command(lib: Library, cc: str, tune: tuple[str, ...], openmp: bool, out: Path) -> list[str]:
    """The compiler's command line that builds ``lib`` into ``out``."""
    extra = _torch_args() if lib.torch else ["-lm"]
    return [cc, *lib.flags, *tune, *(("-fopenmp",) if openmp else ()), "-I", str(lib.csrc), "-o", str(out),
            *map(str, lib.files()), *extra]


def compile_library(lib: Library, cc: str, tune: tuple[str, ...], out: Path, openmp: bool = False) -> None:
    """Compile ``lib`` with ``tune`` into ``out``: in a temporary folder beside it, then renamed into place (a rename is
    atomic only within one file system, and a concurrent build of the same file then only replaces one whole file
    with another). Raises RuntimeError with the compiler's last line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        r = compile_run(command(lib, cc, tune, openmp, built), TIMEOUT_S)
        if r.returncode != 0:
            last = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cc).name} failed: {last[-1] if last else 'exit status ' + str(r.returncode)}")
        os.replace(built, out)


def cached_path(lib: Library, cc: str, tune: tuple[str, ...] = TUNE, openmp: bool = False) -> Path:
    """Where ``lib`` built by ``cc`` with ``tune`` for this CPU (and this torch) is kept."""
    parts = [lib.source_key(), *lib.flags, *tune, str(openmp), cc, cpu_key()]
    if lib.torch:
        parts.append(torch_version())
    return cache_dir() / f"{lib.name}-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:20]}.so"


def prebuilt_name(lib: Library, level: str) -> str:
    """The file name of ``lib``'s prebuilt build for an x86 level (the torch operators: for a torch version)."""
    return f"{lib.name}-torch{level}.so" if lib.torch else f"{lib.name}-{level}.so"


def best_prebuilt(lib: Library, folder: Path | None = None, flags: set[str] | None = None) -> Path | None:
    """The best prebuilt build of ``lib`` this machine runs (None: none shipped, or none that fits: not an x86 Linux
    machine, another torch)."""
    folder = folder or lib.prebuilt
    if not folder.is_dir():
        return None
    if lib.torch:
        path = folder / prebuilt_name(lib, torch_version())
        return path if path.is_file() else None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = cpu_flags() if flags is None else flags
    for name, _, need in LEVELS:
        path = folder / prebuilt_name(lib, name)
        if path.is_file() and all(f in flags for f in need):
            return path
    return None


def _last_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__


_REGISTRY: list[weakref.ref] = []  # every library made in this process (weakly), for ``missing`` and ``report``
_said: set[str] = set()  # the libraries ``missing_note`` has named


def no_compiler(lib: Library) -> str:
    kind = "C++ compiler (c++, g++ or clang++)" if lib.cxx else "C compiler (cc, gcc or clang)"
    return f"no {kind} on PATH and no prebuilt library for this {'torch' if lib.torch else 'CPU'}"


class Native:
    """``lib`` found or built once per process (``library()``), loaded by ``opener`` (ctypes by default) and its
    functions declared by ``declare``; ``why()`` says why there is none, ``origin`` where the one loaded came from."""

    def __init__(self, lib: Library, declare: Callable[[ctypes.CDLL], ctypes.CDLL] = lambda lib: lib,
                 opener: Callable[[str], ctypes.CDLL] = ctypes.CDLL) -> None:
        self.lib, self.declare, self.opener = lib, declare, opener
        self.origin = ""  # where the loaded library came from, in words
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._why: str | None = None  # why there is no library (None: there is one, or nobody asked yet)
        _REGISTRY.append(weakref.ref(self))

    def load(self, tune: tuple[str, ...] = TUNE, openmp: bool | None = None) -> ctypes.CDLL:
        """The library built here with ``tune`` (``()``: for any CPU of this architecture), from the cache or built
        now; declared. Raises RuntimeError / OSError / SubprocessError when that cannot be done."""
        cc = compiler(self.lib.cxx)
        if cc is None:
            raise RuntimeError(no_compiler(self.lib))
        openmp = self.lib.openmp if openmp is None else openmp
        target = cached_path(self.lib, cc, tune, openmp)
        if not target.exists():
            compile_library(self.lib, cc, tune, target, openmp)
        try:
            lib = self.opener(str(target))
        except OSError:  # a cached file that does not load (cut short by a full disk, copied in): built again, once
            target.unlink(missing_ok=True)
            compile_library(self.lib, cc, tune, target, openmp)
            lib = self.opener(str(target))
        return self.declare(lib)

    def _find(self) -> tuple[ctypes.CDLL, str]:
        named = os.environ.get(self.lib.env, "").strip()
        if named:
            return self.declare(self.opener(named)), f"{named} ({self.lib.env})"
        pre, errors = best_prebuilt(self.lib), []
        if pre is not None:
            try:
                return self.declare(self.opener(str(pre))), f"prebuilt {pre.name}"
            except OSError as e:  # e.g. built against a newer C library than this machine's: built here instead
                errors.append(f"prebuilt {pre.name} does not load ({_last_line(e)})")
                log.info("%s", errors[0])
        if compiler(self.lib.cxx) is None:
            raise RuntimeError(errors[0] if errors else no_compiler(self.lib))
        for tune in ((),) if self.lib.torch else (TUNE, ()):
            for openmp in (True, False) if self.lib.openmp else (False,):
                try:
                    how = "for this torch" if self.lib.torch else f"({' '.join(tune) or 'portable'})"
                    return self.load(tune, openmp), f"built here {how}"
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    errors.append(_last_line(e))
        raise RuntimeError(errors[0])

    def library(self) -> ctypes.CDLL | None:
        """The loaded library (None where there is none: ``why()``; said once in the log)."""
        if not enabled():
            return None
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                try:
                    self._lib, self.origin = self._find()
                except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                    self._why = _last_line(e)
                    # said to the user by a load's note (``missing_note``); here for the log
                    log.info("%s: off (%s); %s", self.lib.what, self._why, self.lib.cost)
                self._tried = True
        return self._lib

    def why(self) -> str | None:
        """Why ``library()`` is None (after it was asked), else None."""
        return "KVSCOPE_NATIVE=off" if not enabled() else self._why

    def state(self) -> dict:
        """Asked for yet, loaded, from where, or why not (``report``)."""
        return {"library": self.lib.name, "asked": self._tried, "loaded": self._lib is not None,
                "origin": self.origin, "why": self.why() or ""}


def probe(lib: Library) -> str | None:
    """Why ``lib`` cannot be had here, found without building it: None where a named or prebuilt library is there or
    the compiler runs (``--version``), else the reason ``library()`` would give."""
    if os.environ.get(lib.env, "").strip() or best_prebuilt(lib) is not None:
        return None
    cc = compiler(lib.cxx)
    if cc is None:
        return no_compiler(lib)
    try:
        r = compile_run([cc, "--version"], 10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{Path(cc).name} does not run ({_last_line(e)})"
    return None if r.returncode == 0 else f"{Path(cc).name} failed: exit status {r.returncode}"


def _natives() -> list[Native]:
    return [n for ref in _REGISTRY if (n := ref()) is not None]


def missing() -> list[Native]:
    """The libraries asked for in this process that could not be had (not those turned off by KVSCOPE_NATIVE)."""
    return [n for n in _natives() if enabled() and (s := n.state())["asked"] and not s["loaded"]]


def missing_note() -> str:
    """One line naming each fast path missing here that no earlier note named, and what it costs ('' when none)."""
    new = sorted((n for n in missing() if n.lib.name not in _said), key=lambda n: n.lib.name)  # not import order
    if not new:
        return ""
    _said.update(n.lib.name for n in new)
    whys = {n.why() for n in new}
    if len(whys) == 1:  # usually: no compiler and nothing prebuilt, said once
        return f"native kernels missing ({whys.pop()}): " + "; ".join(f"{n.lib.what}: {n.lib.cost}" for n in new)
    return "native kernels missing: " + "; ".join(f"{n.lib.what} ({n.why()}): {n.lib.cost}" for n in new)


def report() -> list[dict]:
    """Each library asked for in this process: whether it loaded and from where, or why not."""
    return [n.state() for n in _natives() if n.state()["asked"]]
