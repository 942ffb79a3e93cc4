#!/usr/bin/env python3
"""Build KV Scope's one-folder bundle (and the Linux .deb), then prove it by running the frozen self-test.

    python packaging/build.py                 # dist/kvscope/ + frozen self-test
    python packaging/build.py --deb           # ... + kvscope_<version>_<arch>.deb, installed into a
                                              #     temporary root (dpkg-deb -x) and self-tested there
    python packaging/build.py --deb --model resources/models/stories260K   # + bundle check on a real model

Everything goes under --out (default packaging/build-out/, git-ignored): build/ (PyInstaller's work dir),
dist/kvscope/ (the bundle), the .deb, self-test screenshots and report.json (sizes, times, outputs).
The build uses the Python that runs this script (sys.executable) and pip-installs PyInstaller and
pyinstaller-hooks-contrib into it when they are missing. Exit status 0 only if every step and check passed.

Frozen runs happen from another directory under a scrubbed environment (PATH, a throw-away HOME,
QT_QPA_PLATFORM=offscreen, HF_HUB_OFFLINE=1): what a fresh user account has, nothing from the build env.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = "kvscope"
MIN_PYINSTALLER = (6, 11)  # torch hooks need >= 6.11 (bindepend symlink suppression for torch/lib)

# Shared libraries the bundle needs from the system, by soname -> Debian package. PyInstaller never
# bundles glibc, libGL/libEGL/libdrm/libxcb/libwayland (they must match the system's driver stack) and cannot
# bundle what the build machine lacks. Everything Qt's xcb platform plugin links is listed, bundled or not:
# a build host without them would otherwise ship a bundle that aborts on a real X display
# ("could not load the Qt platform plugin xcb"), and Qt names the wrong library (xcb-cursor0) when that happens.
SONAME_PACKAGES = {
    "libc.so.6": "libc6", "libm.so.6": "libc6", "libdl.so.2": "libc6", "libpthread.so.0": "libc6",
    "librt.so.1": "libc6", "libresolv.so.2": "libc6", "ld-linux-x86-64.so.2": "libc6",
    "ld-linux-aarch64.so.1": "libc6", "libutil.so.1": "libc6",
    "libGL.so.1": "libgl1", "libEGL.so.1": "libegl1", "libOpenGL.so.0": "libopengl0", "libdrm.so.2": "libdrm2",
    "libxcb.so.1": "libxcb1", "libX11-xcb.so.1": "libx11-xcb1", "libX11.so.6": "libx11-6",
    "libxcb-cursor.so.0": "libxcb-cursor0", "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0", "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0", "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-render.so.0": "libxcb-render0", "libxcb-shape.so.0": "libxcb-shape0", "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1", "libxcb-xfixes.so.0": "libxcb-xfixes0", "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxcb-xinput.so.0": "libxcb-xinput0", "libxcb-util.so.1": "libxcb-util1",
    "libxkbcommon.so.0": "libxkbcommon0", "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libfontconfig.so.1": "libfontconfig1", "libfreetype.so.6": "libfreetype6", "libdbus-1.so.3": "libdbus-1-3",
    "libglib-2.0.so.0": "libglib2.0-0", "libgthread-2.0.so.0": "libglib2.0-0",
    "libwayland-client.so.0": "libwayland-client0", "libwayland-cursor.so.0": "libwayland-cursor0",
    "libwayland-egl.so.1": "libwayland-egl1",
}
# Always declared (the Qt 6 xcb platform plugin's requirements, see above)
QT_XCB_DEPENDS = [
    "libgl1", "libegl1", "libxcb1", "libx11-xcb1", "libxcb-cursor0", "libxcb-icccm4", "libxcb-image0",
    "libxcb-keysyms1", "libxcb-randr0", "libxcb-render-util0", "libxcb-shape0", "libxcb-xfixes0", "libxcb-xkb1",
    "libxkbcommon0", "libxkbcommon-x11-0", "libfontconfig1", "libfreetype6", "libdbus-1-3",
]
# Qt plugins that are optional at run time: their missing libraries are Recommends, not Depends
# (platformthemes/libqgtk3 needs GTK 3 for native dialogs; Qt falls back to its own without it).
OPTIONAL_PLUGIN_DIRS = ("platformthemes", "egldeviceintegrations")
RECOMMENDS = {"libgtk-3.so.0": "libgtk-3-0", "libgdk-3.so.0": "libgtk-3-0"}
# The NVIDIA driver's own libraries: a CUDA bundle must never carry them (they must match the installed kernel
# module) and must start without them (torch then reports no GPU and the app runs on the CPU, saying why).
DRIVER_SONAMES = ("libcuda.so.1", "libnvidia-ml.so.1")


def log(msg: str) -> None:
    print(f"[build] {msg}", flush=True)


def fail(msg: str) -> None:
    print(f"[build] FAILED: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


# -- environment ------------------------------------------------------------------------------------------
def ensure_pyinstaller(install: bool) -> str:
    def version() -> str | None:
        r = subprocess.run([sys.executable, "-c", "import PyInstaller, _pyinstaller_hooks_contrib as h;"
                            "print(PyInstaller.__version__, h.__version__)"], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    v = version()
    if v is None:
        if not install:
            fail(f"PyInstaller is not installed in {sys.executable} (pip install pyinstaller pyinstaller-hooks-contrib)")
        log(f"installing pyinstaller and pyinstaller-hooks-contrib into {sys.executable}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "pyinstaller>=6.11",
                        "pyinstaller-hooks-contrib"], check=True)
        v = version()
        if v is None:
            fail("PyInstaller still not importable after pip install")
    pyi = tuple(int(x) for x in re.findall(r"\d+", v.split()[0])[:2])
    if pyi < MIN_PYINSTALLER:
        fail(f"PyInstaller {v.split()[0]} is too old: need >= {'.'.join(map(str, MIN_PYINSTALLER))}")
    return v


def check_build_env() -> dict:
    """What is being frozen; refuse the known traps (packaging-notes.md)."""
    code = ("import importlib.util as u, json, torch, transformers, PySide6, pyqtgraph, bitsandbytes;"
            "print(json.dumps({'python': __import__('sys').version.split()[0], 'torch': torch.__version__,"
            "'cuda': torch.version.cuda, 'transformers': transformers.__version__, 'pyside6': PySide6.__version__,"
            "'pyqtgraph': pyqtgraph.__version__, 'bitsandbytes': bitsandbytes.__version__,"
            "'kernels': u.find_spec('kernels') is not None}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"the build env cannot import the app's dependencies:\n{r.stderr[-2000:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if info.pop("kernels"):
        fail("the 'kernels' package is installed: bitsandbytes then downloads CPU kernels from the Hugging Face "
             "hub at import. Uninstall it (pip uninstall kernels) before building.")
    return info


def clean_env(home: Path) -> dict:
    if os.name == "nt":
        sysroot = os.environ.get("SYSTEMROOT", r"C:\Windows")
        path = f"{sysroot}\\System32;{sysroot}"
    else:
        path = "/usr/local/bin:/usr/bin:/bin"
    env = {
        "PATH": path,
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "QT_QPA_PLATFORM": "offscreen",
        "HF_HUB_OFFLINE": "1",  # the self-test uses the built-in demo model: never reach for the network
        "XDG_RUNTIME_DIR": str(home / "run"),
        # a windowed Windows exe has no stdout: the launcher writes its output here instead
        "KVSCOPE_LOG": str(home / "kvscope.log"),
    }
    (home / "run").mkdir(parents=True, exist_ok=True, mode=0o700)
    for k in ("SYSTEMROOT", "TEMP", "TMP"):  # needed by Python on Windows
        if k in os.environ:
            env[k] = os.environ[k]
    return env


def run_frozen(exe: Path, args: list[str], scratch: Path, timeout: int = 600, by_name: bool = False) -> dict:
    """Runs ``exe`` from a fresh home with a scrubbed environment; ``by_name``: started as a user types it, by its
    name found on PATH (its folder first), not by its path."""
    home = Path(tempfile.mkdtemp(prefix="home-", dir=scratch))
    env = clean_env(home)
    if by_name:
        env["PATH"] = f"{exe.parent}{os.pathsep}{env['PATH']}"
    t = time.perf_counter()
    try:
        r = subprocess.run([exe.name if by_name else str(exe), *args], cwd=home, env=env, capture_output=True,
                           text=True, timeout=timeout)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -9, f"{(e.stdout or b'').decode(errors='replace')}\nTIMEOUT after {timeout} s"
    if (home / "kvscope.log").is_file():
        out += (home / "kvscope.log").read_text(encoding="utf-8", errors="replace")
    return {"cmd": [exe.name if by_name else str(exe), *args], "rc": rc, "seconds": round(time.perf_counter() - t, 2), "output": out}


def show(result: dict, what: str) -> None:
    lines = [ln for ln in result["output"].splitlines() if not ln.startswith("[transformers]")]
    log(f"{what}: rc={result['rc']} in {result['seconds']} s")
    for ln in lines[-40:]:
        print("    " + ln, flush=True)


# -- PyInstaller ------------------------------------------------------------------------------------------
def prebuild_native_kernels(src: Path) -> list[str]:
    """The native kernels (engine/native/csrc, engine/quant/csrc) compiled by ``python -m engine.native.prebuild``:
    each C library for every x86 level, the C++ operators for this torch, into the prebuilt folders the spec bundles,
    so a machine without a compiler runs them (the engine loads the best level its CPU has). What could not be built
    is said in one line each; the bundle check then names what is missing (``--bundle-check``: ``native_kernels``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log("native kernels: no prebuilt levels for this architecture (built at first use where a compiler is)")
    r = subprocess.run([sys.executable, "-m", "engine.native.prebuild"], cwd=src, capture_output=True, text=True)
    for line in r.stderr.strip().splitlines():
        log(f"native kernels NOT prebuilt: {line}")
    made = [Path(line).name for line in r.stdout.split()]
    log(f"native kernels prebuilt: {', '.join(made) or 'none'}")
    return made


def pyinstaller(src: Path, out: Path, clean: bool, extra_env: dict) -> float:
    spec = src / "packaging" / "kvscope.spec"
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
           "--distpath", str(out / "dist"), "--workpath", str(out / "build"), str(spec)]
    if clean:
        cmd.insert(4, "--clean")
    env = dict(os.environ, KVSCOPE_SRC=str(src), **extra_env)
    env.pop("PYTHONPATH", None)  # freeze what the env has installed + the source tree, nothing else
    log(" ".join(cmd))
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=src, env=env)
    if r.returncode != 0:
        fail(f"PyInstaller exited with {r.returncode}")
    return time.perf_counter() - t


def check_frozen_sources(src: Path, out: Path) -> dict:
    """The app and engine modules in the bundle must come from --src, not from an installed copy (an
    editable ``pip install -e`` of another checkout, a stale wheel in site-packages)."""
    toc = (out / "build" / NAME / "PYZ-00.toc").read_text(encoding="utf-8")
    found = {}
    for mod in ("app.main", "engine.model.loader"):
        m = re.search(rf"\('{re.escape(mod)}',\s*'([^']+)'", toc)
        if not m:
            fail(f"{mod} is not in the bundle's PYZ (PyInstaller did not find the app)")
        path = Path(m.group(1)).resolve()
        if src not in path.parents:
            fail(f"{mod} was frozen from {path}, not from {src}: another copy of the app is importable in "
                 f"{sys.executable} (uninstall it or build from that checkout)")
        found[mod] = str(path)
    return found


def du(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def size_report(bundle: Path) -> dict:
    internal = bundle / "_internal" if (bundle / "_internal").is_dir() else bundle
    parts = {p.name: du(p) for p in internal.iterdir()}
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:12]
    files = sorted((p for p in bundle.rglob("*") if p.is_file() and not p.is_symlink()),
                   key=lambda p: -p.stat().st_size)[:10]
    return {
        "total_mb": round(du(bundle) / 1e6, 1),
        "by_package_mb": {k: round(v / 1e6, 1) for k, v in top},
        "largest_files_mb": {str(p.relative_to(bundle)): round(p.stat().st_size / 1e6, 1) for p in files},
    }


# -- ELF: which system libraries does the bundle need -----------------------------------------------------
def elf_needed(path: Path) -> list[str] | None:
    """DT_NEEDED sonames of an ELF file (None if it is not a 64-bit little-endian ELF)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    dyn = next((s for s in sections if s[1] == 6), None)  # SHT_DYNAMIC
    if dyn is None:
        return []
    strtab = sections[dyn[6]]  # sh_link -> .dynstr
    names = []
    for off in range(dyn[4], dyn[4] + dyn[5], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            start = strtab[4] + val
            names.append(data[start:data.index(b"\0", start)].decode())
    return names


def system_dependencies(bundle: Path) -> dict:
    """Sonames the bundle needs but does not carry, mapped to packages; glibc version from symbol versions."""
    bundled = {p.name for p in bundle.rglob("*")}
    needed: dict[str, set[str]] = {}
    optional: dict[str, set[str]] = {}
    glibc = (2, 17)
    for p in bundle.rglob("*"):
        if not p.is_file() or p.is_symlink():
            continue
        names = elf_needed(p)
        if names is None:
            continue
        rel = str(p.relative_to(bundle))
        is_optional = any(f"/plugins/{d}/" in "/" + rel for d in OPTIONAL_PLUGIN_DIRS)
        for n in names:
            if n not in bundled:
                (optional if is_optional else needed).setdefault(n, set()).add(rel)
        for m in re.finditer(rb"GLIBC_2\.(\d+)", p.read_bytes()):
            glibc = max(glibc, (2, int(m.group(1))))
    unknown = sorted(n for n in needed if n not in SONAME_PACKAGES)
    depends = {SONAME_PACKAGES[n] for n in needed if n in SONAME_PACKAGES} | set(QT_XCB_DEPENDS)
    depends.discard("libc6")
    recommends = sorted({RECOMMENDS.get(n) or SONAME_PACKAGES.get(n) for n in optional} - {None} - depends
                        - {"libc6"})
    return {
        "glibc": f"{glibc[0]}.{glibc[1]}",
        "depends": [f"libc6 (>= {glibc[0]}.{glibc[1]})"] + sorted(depends),
        "recommends": recommends,
        "unbundled_sonames": sorted(needed),
        "unknown_sonames": {n: sorted(needed[n])[:3] for n in unknown},
    }


# -- .deb -------------------------------------------------------------------------------------------------
def find_icon(src: Path) -> Path | None:
    icons = src / "resources" / "icons"
    for ext in ("svg", "png"):
        for stem in ("kvscope", "app", "icon"):
            if (icons / f"{stem}.{ext}").is_file():
                return icons / f"{stem}.{ext}"
    found = sorted((p for p in icons.rglob("*") if p.suffix in (".svg", ".png")),
                   key=lambda p: (p.suffix != ".svg", -p.stat().st_size)) if icons.is_dir() else []
    return found[0] if found else None


def png_size(path: Path) -> int:
    w, h = struct.unpack(">II", path.read_bytes()[16:24])
    return max(w, h)


def project_version(src: Path) -> str:
    text = (src / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', text)
    return m.group(1) if m else "0.0.0"


def build_deb(src: Path, bundle: Path, out: Path, deps: dict, compression: str, cuda: str | None = None) -> Path:
    """The .deb of ``bundle``. A bundle frozen with a CUDA build of torch (``cuda``: its CUDA version) is
    versioned ``<version>+cu<NNN>`` (same package: it replaces the CPU build and back) and says in its
    description that the GPU needs the NVIDIA driver."""
    version = project_version(src) + (f"+cu{cuda.replace('.', '')}" if cuda else "")
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    root = out / "deb-root"
    shutil.rmtree(root, ignore_errors=True)
    opt = root / "opt" / NAME
    opt.parent.mkdir(parents=True)
    # hard links when possible: the bundle is ~850 MB and dpkg-deb only reads it
    try:
        shutil.copytree(bundle, opt, symlinks=True, copy_function=os.link)
    except OSError:
        shutil.rmtree(opt, ignore_errors=True)
        shutil.copytree(bundle, opt, symlinks=True)
    (root / "usr" / "bin").mkdir(parents=True)
    # relative, so it also resolves inside a dpkg -x root; the bootloader finds _internal via /proc/self/exe
    os.symlink(f"../../opt/{NAME}/{NAME}", root / "usr" / "bin" / NAME)

    icon = find_icon(src)
    if icon is None:
        fail(f"no icon in {src / 'resources' / 'icons'} (expected kvscope.svg or kvscope.png) for the .deb")
    hicolor = root / "usr/share/icons/hicolor"
    if icon.suffix == ".svg":
        (hicolor / "scalable/apps").mkdir(parents=True)
        shutil.copyfile(icon, hicolor / "scalable/apps" / f"{NAME}.svg")
    # every square PNG size the app ships (kvscope-48.png, ...): menus and docks prefer exact sizes
    pngs = [p for p in icon.parent.glob(f"{NAME}*.png")] + ([icon] if icon.suffix == ".png" else [])
    for png in pngs:
        n = png_size(png)
        dest = hicolor / f"{n}x{n}/apps" / f"{NAME}.png"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, dest)
    apps = root / "usr/share/applications"
    apps.mkdir(parents=True)
    shutil.copyfile(HERE / "linux" / f"{NAME}.desktop", apps / f"{NAME}.desktop")
    doc = root / "usr/share/doc" / NAME
    doc.mkdir(parents=True)
    shutil.copyfile(HERE / "linux" / "copyright", doc / "copyright")

    installed_kb = (du(root) + 1023) // 1024
    control = (HERE / "linux" / "control.in").read_text(encoding="utf-8").format(
        version=version, arch=arch, installed_size=installed_kb, depends=", ".join(deps["depends"]),
        recommends=", ".join(deps["recommends"]) or "libgtk-3-0",
        torch_build=f"PyTorch with the CUDA {cuda} runtime" if cuda else "PyTorch CPU",
        gpu_note=(f"\n .\n This build runs models on an NVIDIA GPU through the installed NVIDIA driver\n"
                  f" (CUDA {cuda} runtime bundled, the driver is not); without the driver it\n"
                  " runs on the CPU and says why.") if cuda else "",
    )
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN" / "control").write_text(control, encoding="utf-8")
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        d.chmod(0o755)  # mktemp-style 0700 dirs would make /opt/kvscope unreadable to users
    for f in (root / "usr/share").rglob("*"):
        if f.is_file():
            f.chmod(0o644)
    (root / "DEBIAN" / "control").chmod(0o644)

    deb = out / f"{NAME}_{version}_{arch}.deb"
    level = {"zstd": ["-Zzstd", "-z3"], "xz": ["-Zxz", "-z6"], "gzip": ["-Zgzip", "-z6"], "none": ["-Znone"]}
    cmd = ["dpkg-deb", "--root-owner-group", *level[compression], "--build", str(root), str(deb)]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(root)
    return deb


def check_deb(deb: Path, out: Path, deps: dict) -> dict:
    """Unpack the .deb into a temporary root and check its files; returns {root, exe, info}."""
    root = out / "deb-installed"
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    info = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout
    launcher = root / "usr" / "bin" / NAME
    problems = []
    if not launcher.is_symlink() or not launcher.resolve().is_file():
        problems.append("/usr/bin/kvscope does not resolve to /opt/kvscope/kvscope")
    desktop = root / "usr/share/applications" / f"{NAME}.desktop"
    text = desktop.read_text(encoding="utf-8") if desktop.is_file() else ""
    if f"Exec={NAME}" not in text or f"Icon={NAME}" not in text:
        problems.append("kvscope.desktop lacks Exec=kvscope / Icon=kvscope")
    if not list((root / "usr/share/icons/hicolor").rglob(f"{NAME}.*")):
        problems.append("no icon in /usr/share/icons/hicolor")
    if shutil.which("desktop-file-validate"):
        r = subprocess.run(["desktop-file-validate", str(desktop)], capture_output=True, text=True)
        if r.returncode != 0 or "error" in r.stdout.lower():
            problems.append(f"desktop-file-validate: {r.stdout.strip()}")
    # every library the extracted bundle cannot find on this machine must be covered by Depends
    missing = set()
    for p in (root / "opt" / NAME).rglob("*.so*"):
        if any(f"/plugins/{d}/" in str(p) for d in OPTIONAL_PLUGIN_DIRS) or not p.is_file():
            continue
        r = subprocess.run(["ldd", str(p)], capture_output=True, text=True)
        missing.update(m.group(1) for m in re.finditer(r"^\s*(\S+) => not found", r.stdout, re.M))
    declared = {d.split()[0] for d in deps["depends"]}
    # a library bundled in another folder than the one asking (bitsandbytes' CUDA library wants torch's
    # libcublas): the loader finds it by soname once torch, always imported first, has loaded it
    bundled = {p.name for p in (root / "opt" / NAME).rglob("*.so*")}
    driver = sorted(n for n in missing if n in DRIVER_SONAMES)
    by_soname = sorted(n for n in missing if n in bundled)
    uncovered = sorted(n for n in missing - set(driver) - set(by_soname) if SONAME_PACKAGES.get(n) not in declared)
    if uncovered:
        problems.append(f"libraries neither bundled, on this system, nor in Depends: {uncovered}")
    carried = sorted(n for n in bundled if n.split(".so")[0] + ".so.1" in DRIVER_SONAMES)
    if carried:
        problems.append(f"the NVIDIA driver's libraries are bundled (they must come from the installed driver): {carried}")
    if problems:
        fail("the .deb is broken: " + "; ".join(problems))
    return {"root": root, "exe": launcher, "control": info, "missing_here_covered_by_depends": sorted(missing),
            "from_the_nvidia_driver": driver, "bundled_resolved_by_soname": by_soname}


def expect_device(r: dict) -> None:
    """A CUDA bundle's self-test must name its device: the GPU where the NVIDIA driver is, else the CPU with
    the reason (no driver here: ``libcuda.so.1`` is the driver's, never bundled)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        expect = "on cuda (CUDA:"
    except OSError:
        expect = "on cpu (CPU: no NVIDIA driver found"
    if expect not in r["output"]:
        r["rc"] = 1
        r["output"] += f"\n(the CUDA build's self-test did not report {expect!r})"


# -- main -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, default=HERE.parent, help="source tree to freeze (default: this checkout)")
    p.add_argument("--out", type=Path, default=HERE / "build-out", help="where build/, dist/ and the .deb go")
    p.add_argument("--deb", action="store_true", help="also build the .deb and self-test it from a dpkg -x root")
    p.add_argument("--deb-compression", default="zstd", choices=("zstd", "xz", "gzip", "none"),
                   help="zstd -3: ~10 s, 282 MB; xz -6: ~140 s, 186 MB (default zstd)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="also run the frozen --bundle-check on this GGUF file (loaded through transformers' GGUF support)")
    p.add_argument("--model", type=Path, default=None,
                   help="also run the frozen --bundle-check on this local model folder (float32 and NF4)")
    p.add_argument("--skip-self-test", action="store_true", help="build only (the bundle is NOT verified)")
    p.add_argument("--clean", action="store_true", help="pass --clean to PyInstaller (no cached analysis)")
    p.add_argument("--no-install", action="store_true", help="do not pip-install PyInstaller when it is missing")
    args = p.parse_args(argv)

    src, out = args.src.resolve(), args.out.resolve()
    if not (src / "packaging" / "kvscope.spec").is_file():
        fail(f"{src} has no packaging/kvscope.spec")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvscope-run-"))
    report: dict = {"src": str(src), "out": str(out), "python": sys.executable}
    t_all = time.perf_counter()
    try:
        report["pyinstaller"] = ensure_pyinstaller(install=not args.no_install)
        report["env"] = check_build_env()
        report["native_kernels"] = prebuild_native_kernels(src)
        log(f"freezing {src} with {report['env']} (PyInstaller, hooks-contrib {report['pyinstaller']})")
        extra = {k: v for k, v in os.environ.items() if k.startswith("KVSCOPE_")}
        report["build_seconds"] = round(pyinstaller(src, out, args.clean, extra), 1)
        bundle = out / "dist" / NAME
        exe = bundle / (NAME + ".exe" if os.name == "nt" else NAME)
        if not exe.is_file():
            fail(f"PyInstaller produced no {exe}")
        report["frozen_sources"] = check_frozen_sources(src, out)
        report["size"] = size_report(bundle)
        log(f"bundle {bundle}: {report['size']['total_mb']} MB, built in {report['build_seconds']} s")
        log(f"by package (MB): {report['size']['by_package_mb']}")

        checks: list[tuple[str, dict]] = []
        if not args.skip_self_test:
            shot = out / "self-test.png"
            r = run_frozen(exe, ["--self-test", "--screenshot", str(shot)], scratch)
            show(r, "frozen self-test (dist)")
            report["self_test"] = r
            checks.append(("frozen self-test", r))
            if report["env"].get("cuda") and r["rc"] == 0:
                expect_device(r)
            if r["rc"] == 0 and not shot.is_file():
                r["rc"] = 1
                r["output"] += "\n(no screenshot was written)"
            app_exe = out / "dist" / "KV Scope.app" / "Contents" / "MacOS" / NAME
            if sys.platform == "darwin":  # the BUNDLE section's .app wraps the same tree: test it too
                r = run_frozen(app_exe, ["--self-test"], scratch) if app_exe.is_file() else {
                    "rc": 1, "seconds": 0, "output": f"no {app_exe}", "cmd": []}
                show(r, "frozen self-test (KV Scope.app)")
                report["app_self_test"] = r
                checks.append(("self-test of KV Scope.app", r))
            bc_args = ["--bundle-check", "--json", str(out / "bundle-check.json")]
            if args.model:
                bc_args += ["--model", str(args.model.resolve())]
            if args.gguf:
                bc_args += ["--gguf", str(args.gguf.resolve())]
            r = run_frozen(exe, bc_args, scratch)
            show(r, "frozen bundle check (dist)")
            report["bundle_check"] = r
            checks.append(("frozen bundle check", r))

        if args.deb:
            if sys.platform != "linux" or not shutil.which("dpkg-deb"):
                fail("--deb needs Linux with dpkg-deb")
            deps = system_dependencies(bundle)
            report["deb_dependencies"] = deps
            if deps["unknown_sonames"]:
                log(f"warning: system libraries with no known package (add them to SONAME_PACKAGES): "
                    f"{deps['unknown_sonames']}")
            t = time.perf_counter()
            deb = build_deb(src, bundle, out, deps, args.deb_compression, report["env"].get("cuda"))
            report["deb"] = {"path": str(deb), "mb": round(deb.stat().st_size / 1e6, 1),
                             "seconds": round(time.perf_counter() - t, 1), "compression": args.deb_compression}
            log(f"{deb.name}: {report['deb']['mb']} MB in {report['deb']['seconds']} s; "
                f"Depends: {', '.join(deps['depends'])}")
            installed = check_deb(deb, out, deps)
            report["deb"]["control"] = installed["control"]
            for key in ("missing_here_covered_by_depends", "from_the_nvidia_driver", "bundled_resolved_by_soname"):
                report["deb"][key] = installed[key]
            if not args.skip_self_test:
                r = run_frozen(installed["exe"], ["--self-test", "--screenshot", str(out / "self-test-deb.png")],
                               scratch, by_name=True)
                show(r, "frozen self-test (from the .deb: kvscope by name, /usr/bin on PATH)")
                report["deb_self_test"] = r
                checks.append(("self-test from the .deb", r))
            shutil.rmtree(installed["root"], ignore_errors=True)

        bad = [name for name, r in checks if r["rc"] != 0]
        report["ok"] = not bad
        if bad:
            fail(f"{', '.join(bad)} failed (see above; report in {out / 'report.json'})")
        log(f"OK in {time.perf_counter() - t_all:.0f} s: {bundle}" + (f", {report['deb']['path']}" if args.deb else ""))
        return 0
    finally:
        report.setdefault("ok", False)  # a fail() above leaves it unset
        report["total_seconds"] = round(time.perf_counter() - t_all, 1)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
