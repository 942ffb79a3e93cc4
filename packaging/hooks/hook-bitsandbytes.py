"""Replaces pyinstaller-hooks-contrib's hook-bitsandbytes (hooks in kvscope.spec's hookspath win).

The contrib hook collects every native library bitsandbytes ships (CPU, 7 CUDA, 6 ROCm, 2 XPU builds:
124 MB) and PyInstaller then also collects whatever CUDA/ROCm runtime the *build* machine has for each of
them. bitsandbytes loads exactly one: libbitsandbytes_cpu, or the one named after torch.version.cuda / hip.
So collect the CPU library (the CPU code path; without it bitsandbytes silently falls back, see
packaging-notes.md) plus the one matching the torch being frozen. KVSCOPE_KEEP_GPU_LIBS=1 keeps them all.
"""

import os
import re

from PyInstaller.utils.hooks import collect_dynamic_libs, get_module_attribute, logger


def _gpu_choice(names: list[str], prefix: str, version: str) -> str | None:
    """The library bitsandbytes.cextension.get_cuda_bnb_library_path picks for this torch: the exact
    version, else the highest lower one of the same major, else the lowest higher one of the same major."""
    major, minor = (int(x) for x in version.split(".")[:2])
    split = 1 if prefix == "rocm" else 2  # rocm72 -> (7, 2); cuda128 -> (12, 8)
    avail = {}
    for n in names:
        m = re.fullmatch(rf"libbitsandbytes_{prefix}(\d+)", n)
        if m:
            avail[(int(m.group(1)[:split]), int(m.group(1)[split:]))] = n
    want = (major, minor)
    if want in avail:
        return avail[want]
    lower = [v for v in avail if v[0] == major and v < want]
    higher = [v for v in avail if v[0] == major and v > want]
    if lower:
        return avail[max(lower)]
    return avail[min(higher)] if higher else None


def _wanted(names: list[str]) -> set[str] | None:
    if os.environ.get("KVSCOPE_KEEP_GPU_LIBS") == "1":
        return None
    keep = {"libbitsandbytes_cpu"}
    for prefix, attr in (("cuda", "cuda"), ("rocm", "hip")):
        try:
            version = get_module_attribute("torch.version", attr)
        except Exception:
            version = None
        if version:
            choice = _gpu_choice(names, prefix, str(version))
            if choice:
                keep.add(choice)
    return keep


_all = collect_dynamic_libs("bitsandbytes")
_keep = _wanted([os.path.basename(s).split(".")[0] for s, _ in _all])
binaries = []
for src, dest in _all:
    m = re.match(r"(libbitsandbytes_[a-z0-9]+)\.(so|dll|dylib)$", os.path.basename(src))
    if _keep is None or (m and m.group(1) in _keep) or not m:
        binaries.append((src, dest))
logger.info("kvscope hook-bitsandbytes: collecting %s", sorted(os.path.basename(s) for s, _ in binaries))

# bitsandbytes uses triton's JIT when it is installed, which needs the .py sources (as the contrib hook)
module_collection_mode = "pyz+py"
