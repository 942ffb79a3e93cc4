"""The one build path of the native kernels (``engine.native``): every kernel is a source file the build reads (none in
Python strings), a user's own build wins, else the best prebuilt level the CPU runs (what the installers and the wheel
ship), else a build here; with no compiler and nothing prebuilt the torch paths run and a load says once which fast
paths are missing and what they cost."""

from __future__ import annotations

import ast
import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model import linear_kernel
from engine.native import build, prebuild
from engine.native.libraries import ALL, ATTEND, KQ, LINEAR, TORCH_OPS

ROOT = Path(__file__).resolve().parents[2]
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c", "bmi2"}


def test_every_library_builds_from_source_files_and_no_python_string_holds_c():
    for lib in ALL:
        assert lib.files() and all(p.is_file() and p.suffix in (".c", ".cpp") for p in lib.files()), lib.name
    hints = ("#include", "__m512", "__m256", "static inline")
    for path in [*ROOT.joinpath("engine").rglob("*.py"), *ROOT.joinpath("app").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.count("\n") > 3:
                assert not any(h in node.value for h in hints), f"C source in a Python string: {path}"


@pytest.mark.parametrize("lib", [ATTEND, LINEAR, KQ], ids=lambda lib: lib.name)
def test_the_best_prebuilt_level_this_cpu_runs_is_taken(lib, tmp_path, monkeypatch):
    """The installers ship one library per x86 level: the best the CPU's flags allow wins; none on another
    architecture (built there at first use)."""
    for name, _, _ in build.LEVELS:
        (tmp_path / f"{lib.name}-{name}.so").write_bytes(b"")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for flags, want in ((AVX512 | {"avx512_bf16"}, "avx512bf16"), (AVX512, "avx512vnni"),
                        ({"avx2", "fma", "f16c", "bmi2"}, "avx2"), ({"sse4_2"}, "generic")):
        assert build.best_prebuilt(lib, tmp_path, flags).name == f"{lib.name}-{want}.so"
    (tmp_path / f"{lib.name}-generic.so").unlink()
    assert build.best_prebuilt(lib, tmp_path, {"sse4_2"}) is None
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert build.best_prebuilt(lib, tmp_path, AVX512) is None


def test_the_operators_prebuilt_for_another_torch_are_not_loaded(tmp_path):
    (tmp_path / "torch_ops-torch0.0.1.so").write_bytes(b"")
    assert build.best_prebuilt(TORCH_OPS, tmp_path) is None
    (tmp_path / f"torch_ops-torch{torch.__version__}.so").write_bytes(b"")
    assert build.best_prebuilt(TORCH_OPS, tmp_path).name == f"torch_ops-torch{torch.__version__}.so"


def test_a_prebuilt_library_runs_without_a_compiler(tmp_path, monkeypatch):
    """What an installer's machine sees: CC and CXX are ``false``, the cache is empty, a prebuilt level is there."""
    if build.compiler(cxx=False) is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs a C compiler and an x86 machine to make the prebuilt level")
    lib = dataclasses.replace(LINEAR, prebuilt=tmp_path / "prebuilt")
    level = next(name for name, _, need in build.LEVELS if need and all(f in build.cpu_flags() for f in need))
    tune = dict((name, tune) for name, tune, _ in build.LEVELS)[level]
    build.compile_library(lib, build.compiler(cxx=False), tune, lib.prebuilt / build.prebuilt_name(lib, level))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    got = build.Native(lib, linear_kernel.LINEAR.declare)
    assert got.library() is not None and got.origin == f"prebuilt linear-{level}.so"
    x, wb = torch.randn(3, 40), torch.randn(2, 40, 16)
    y = torch.empty(3, 32)
    got.library().kvs_blocked_mm(3, 40, 0, 2, x.data_ptr(), wb.data_ptr(), None, y.data_ptr(), 32)
    assert torch.allclose(y, linear_kernel.torch_product(x, wb, None), atol=1e-5)
    assert not (tmp_path / "cache").exists()  # nothing built


def test_a_library_the_user_names_wins(tmp_path, monkeypatch):
    if linear_kernel.LINEAR.library() is None:
        pytest.skip(f"no library to name: {linear_kernel.LINEAR.why()}")
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv(LINEAR.env, linear_kernel.LINEAR.library()._name)
    got = build.Native(LINEAR, linear_kernel.LINEAR.declare)
    assert got.library() is not None and got.origin == f"{linear_kernel.LINEAR.library()._name} ({LINEAR.env})"
    monkeypatch.setenv(LINEAR.env, str(tmp_path / "mine.so"))
    got = build.Native(LINEAR)
    assert got.library() is None and "mine.so" in got.why()  # named, not there: said, not replaced by another


def test_no_compiler_and_nothing_prebuilt_say_once_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "_said", set())  # what earlier notes of this process named
    libs = [build.Native(dataclasses.replace(lib, prebuilt=tmp_path / "none")) for lib in (ATTEND, LINEAR)]
    assert all(n.library() is None for n in libs)
    assert [n.why() for n in libs] == ["false failed: exit status 1"] * 2
    note = build.missing_note()
    assert note.startswith("native kernels missing (false failed: exit status 1): the fused decode attention: ")
    assert f"{LINEAR.what}: {LINEAR.cost}" in note
    assert build.missing_note() == ""  # once
    assert not list(tmp_path.rglob("*.so"))
    monkeypatch.delenv("CC")
    monkeypatch.setattr(build, "compiler", lambda cxx: None)
    assert build.probe(TORCH_OPS) == "no C++ compiler (c++, g++ or clang++) on PATH and no prebuilt library for this torch"


def test_a_load_without_compilers_or_prebuilt_libraries_says_which_fast_paths_are_missing(tmp_path):
    """The command line's load of the shipped model: one ``note:`` line names the missing kernels and their cost (the
    GGUF block kernels are not asked for a folder's model), and the reply is the same story."""
    if any(best := [build.best_prebuilt(lib) for lib in (ATTEND, LINEAR, TORCH_OPS)]):
        pytest.skip(f"prebuilt libraries in this checkout: {best}")
    env = {**os.environ, "CC": "false", "CXX": "false", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("KVSCOPE_NATIVE", None)
    cmd = [sys.executable, "-m", "engine", "generate", "--model", str(ROOT / "resources/models/stories260K"),
           "--prompt", "Once", "--max-new-tokens", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = [ln for ln in out.stderr.splitlines() if "native kernels missing" in ln]
    assert missing == [f"note: native kernels missing (false failed: exit status 1): {ATTEND.what}: {ATTEND.cost}; "
                       f"{LINEAR.what}: {LINEAR.cost}; {TORCH_OPS.what}: {TORCH_OPS.cost}"], out.stderr
    assert out.stdout.startswith(" upon a time")
    assert not list(tmp_path.rglob("*.so"))


def test_the_prebuild_command_refuses_an_unknown_library_in_one_line():
    out = subprocess.run([sys.executable, "-m", "engine.native.prebuild", "--only", "attend,nope"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and out.stderr == "--only: nope is not one of attend, linear, kq, torch_ops\n"


def test_the_prebuild_jobs_are_every_level_of_every_c_library_and_the_operators_for_this_torch(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    jobs = [(lib.name, level) for lib, level, _, _ in prebuild.jobs()]
    levels = [name for name, _, _ in build.LEVELS]
    assert jobs == [*((n, lv) for n in ("attend", "linear", "kq") for lv in levels), ("torch_ops", torch.__version__)]
