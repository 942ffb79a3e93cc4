"""Build the libraries the installers and the wheel ship, so that a machine without a compiler runs the kernels:
every C library once per x86 level (``engine.native.build.LEVELS``; the engine loads the best one the CPU runs), the
C++ operators once for the running torch (a bundle and a wheel carry the torch they were built with).

    python -m engine.native.prebuild [--only NAME,...]

Each library goes to its own ``prebuilt`` folder beside its sources (``engine/native/prebuilt``,
``engine/quant/prebuilt``). Needs a C and a C++ compiler that know the x86 levels (GCC 11+, clang 12+); the levels
are built side by side, one per core. Prints each file made; exit status 1 (and the compiler's last line) when one
could not be built, 2 for a bad argument.
"""

from __future__ import annotations

import concurrent.futures
import os
import platform
import subprocess
import sys
from pathlib import Path

from engine.native import build
from engine.native.libraries import ALL


def jobs(only: tuple[str, ...] = ()) -> list[tuple[build.Library, str, tuple[str, ...], bool]]:
    """(library, level, compiler flags, openmp) for each file to build; the x86 levels only on an x86 machine (a
    portable build elsewhere, which the engine does not load: built at first use there)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    out = []
    for lib in ALL:
        if only and lib.name not in only:
            continue
        if lib.torch:
            try:
                out.append((lib, build.torch_version(), (), False))
            except ImportError:  # an isolated wheel build: nothing to build the operators against
                out.append((lib, "", (), False))
        elif x86:
            out += [(lib, name, tune, lib.openmp) for name, tune, _ in build.LEVELS]
    return out


def _one(lib: build.Library, level: str, tune: tuple[str, ...], openmp: bool) -> Path:
    if lib.torch and not level:
        raise RuntimeError("torch is not installed where this runs (a wheel: build it with --no-build-isolation)")
    cc = build.compiler(lib.cxx)
    if cc is None:
        raise RuntimeError(build.no_compiler(lib))
    out = lib.prebuilt / build.prebuilt_name(lib, level)
    build.compile_library(lib, cc, tune, out, openmp)
    return out


def prebuild(only: tuple[str, ...] = ()) -> tuple[list[Path], list[str]]:
    """Build them all (side by side); returns the files made and one line per file that failed."""
    made, failed = [], []
    with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        futures = {pool.submit(_one, *job): job for job in jobs(only)}
        for f in concurrent.futures.as_completed(futures):
            lib, level = futures[f][:2]
            try:
                made.append(f.result())
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                failed.append(f"{build.prebuilt_name(lib, level)}: {str(e).strip().splitlines()[-1] if str(e) else e}")
    return sorted(made), failed


def main(argv: list[str]) -> int:
    only: tuple[str, ...] = ()
    if argv[:1] == ["--only"] and len(argv) == 2:
        only = tuple(argv[1].split(","))
        unknown = sorted(set(only) - {lib.name for lib in ALL})
        if unknown:
            print(f"--only: {', '.join(unknown)} is not one of {', '.join(lib.name for lib in ALL)}", file=sys.stderr)
            return 2
    elif argv:
        print("usage: python -m engine.native.prebuild [--only NAME,...]", file=sys.stderr)
        return 2
    made, failed = prebuild(only)
    for p in made:
        print(p)
    for line in failed:
        print(f"not built: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
