"""The KV disk tier against a folder someone else wrote into (#29 item 2): the tampering, and a process that
meets it.

``python -m tests.engine.kv_tamper run FOLDER [--budget BYTES] [--seeds 0,1] [--length 200]`` loads
stories260K in a process of its own (a FIFO that blocked would hang only it; its peak RSS is its own), turns the
tier on at FOLDER, answers each prompt greedily (12 tokens) and prints one JSON line: the tokens, notes,
tier stats, restored tokens, the chats' milliseconds and the process's peak RSS in MiB.

``python -m tests.engine.kv_tamper table`` writes a clean folder, tampers with copies of it one case each
(``CASES``), runs a reader on each and prints the tamper table of the closing note (handled cleanly or not,
peak RSS and time against the clean reader's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORIES = Path(os.environ.get("KVSCOPE_STORIES") or ROOT / "resources" / "models" / "stories260K")
P = 16
TWO_GIB = 2 << 30
MAGIC = b"KVSCOPE-PAGE-2\n"  # engine.kv.tier.page_file.MAGIC (this file runs before torch is imported)


def prompt_ids(seed: int = 0, length: int = 200) -> list[int]:
    """A prompt of ``length`` ids; seed 0 is tests/engine/test_kv_disk.py's IDS (12 restorable pages)."""
    return [5 + (i * 37 + seed * 13) % 400 for i in range(length)]


def chat(lm, ids, n: int = 12):
    """Greedy reply of ``n`` tokens to ``ids``: (tokens, its last stats, its notes)."""
    from engine.config import CacheConfig, SamplingConfig
    from engine.core.session import ChatSession

    s = ChatSession(lm, CacheConfig(page_size=P))
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    out = s.generated_ids
    s.close()
    return out, r.stats, list(r.warnings)


def chain_paths(folder: Path, ids: list[int], pages: int = 12) -> list[Path]:
    """The page files of ``ids``'s first ``pages`` pages in ``folder`` (its one shelf)."""
    from engine.kv.paged.prefix import ROOT as CHAIN_ROOT
    from engine.kv.paged.prefix import extend_chain

    shelf = next(p for p in folder.iterdir() if p.is_dir())
    return [shelf / (h.hex() + ".kvp") for h in extend_chain([], ids, P, pages, CHAIN_ROOT)]


# -- the tampering: each takes a page file's path, its valid bytes and a scratch folder outside the tier's --------
def _deep_header(path: Path, raw: bytes, scratch: Path) -> None:  # the attacker's file: 100,000 levels deep
    deep = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(MAGIC + struct.pack("<I", len(deep)) + deep + raw[-4096:])


def _deep_exact(path: Path, raw: bytes, scratch: Path) -> None:  # deep, in a file of the right size: parse sees it
    (hlen,) = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])
    deep = b"[" * (hlen // 2) + b"]" * (hlen - hlen // 2)
    path.write_bytes(raw[:len(MAGIC) + 4] + deep + raw[len(MAGIC) + 4 + hlen:])


def _link_2gib(path: Path, raw: bytes, scratch: Path) -> None:
    big = scratch / "big.bin"
    with open(big, "wb") as f:
        f.truncate(TWO_GIB)  # sparse: 2 GiB to read, no disk used
    path.unlink()
    path.symlink_to(big)


def _file_2gib(path: Path, raw: bytes, scratch: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(TWO_GIB)


def _fifo(path: Path, raw: bytes, scratch: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _socket(path: Path, raw: bytes, scratch: Path) -> None:
    path.unlink()
    short = Path(tempfile.mkdtemp(dir="/tmp")) / "s"  # a socket's path has at most 107 bytes: made here, moved
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(short))
    os.rename(short, path)
    short.parent.rmdir()


def _empty_dir(path: Path, raw: bytes, scratch: Path) -> None:
    path.unlink()
    path.mkdir()


def _full_dir(path: Path, raw: bytes, scratch: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "keep").write_text("someone's")


def _nan(path: Path, raw: bytes, scratch: Path) -> None:
    """NaN payload, checksum recomputed with the folder's key (as its owner could): a file that passes every
    check but the values."""
    from engine.kv.tier.page_file import mac

    (hlen,) = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])
    off = len(MAGIC) + 4 + hlen
    payload = struct.pack("<f", float("nan")) * ((len(raw) - off) // 4)
    header = raw[len(MAGIC) + 4:off]
    old = json.loads(header)["hmac"].encode()
    key = (path.parent.parent / ".key").read_bytes()
    header = header.replace(old, mac(key, bytes.fromhex(path.stem), path.parent.name, payload).encode())
    path.write_bytes(raw[:len(MAGIC) + 4] + header + payload)


def _renamed_header(path: Path, raw: bytes, scratch: Path) -> None:
    """Another page's valid file, its header's name rewritten to this page's: another prompt's K/V offered."""
    other = next(p for p in sorted(path.parent.glob("*.kvp")) if p != path)
    path.write_bytes(other.read_bytes().replace(other.stem.encode(), path.stem.encode()))


# name -> (tamper, words the note has, whether a page file is at the page path afterwards: the thing there removed
# and the recomputed page written anew)
CASES = {
    "FIFO at a page path": (_fifo, "a pipe (FIFO), not a page file", True),
    "100,000-deep JSON header": (_deep_header, "bytes where a page file has", True),
    "deep header, right size": (_deep_exact, "damaged header (nested too deep)", True),
    "symlink to a 2 GiB file": (_link_2gib, "a symbolic link, not a page file", True),
    "2 GiB file at a page path": (_file_2gib, "too large: 2,147,483,648 bytes", True),
    "socket at a page path": (_socket, "unreadable", True),
    "empty directory at a page path": (_empty_dir, "a directory, not a page file", True),
    "directory with a file in it": (_full_dir, "cannot be removed", False),
    "NaN payload, valid checksum": (_nan, "values not finite (NaN or inf)", True),
    "another page's file, header renamed": (_renamed_header, "checksum mismatch", True),
}


# -- small or read-only file systems ---------------------------------------------------------------------------
def mount_tmpfs(path: Path, size: str, read_only: bool = False) -> str:
    """A tmpfs of ``size`` at ``path`` (read-only when asked, empty): "" or why it cannot be mounted here (not
    root, or no mount in this container). ``unmount`` it afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if p.returncode:
        return p.stderr.strip() or f"mount exited {p.returncode}"
    if read_only:
        p = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
        if p.returncode:
            unmount(path)
            return p.stderr.strip() or "remount,ro failed"
    return ""


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


# -- the process that meets it ----------------------------------------------------------------------------------
def run(folder: str | None, budget: int, seeds: list[int], length: int) -> dict:
    from engine.kv.tier import disk
    from engine.model.loader import load_model

    lm = load_model(str(STORIES))
    tier = disk.configure(lm, folder, budget) if folder else None
    t0, out = time.perf_counter(), []
    for seed in seeds:
        tokens, stats, notes = chat(lm, prompt_ids(seed, length))
        out.append({"tokens": tokens, "restored": stats.disk_restored_tokens, "notes": notes})
    ms = (time.perf_counter() - t0) * 1000.0
    if tier is not None:
        tier.flush()
    late = tier.take_notes() if tier is not None else []
    stats = tier.stats() if tier is not None else {}
    if tier is not None:
        disk.configure(lm, None)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    return {"chats": out, "late_notes": late, "stats": stats, "ms": ms, "rss_mib": rss}


def command(folder, budget: int = 4 << 30, seeds=(0,), length: int = 200) -> tuple[list[str], dict]:
    """The command line and environment of a ``run`` process (started in ``ROOT``)."""
    cmd = [sys.executable, "-m", "tests.engine.kv_tamper", "run", str(folder or ""), "--budget", str(budget),
           "--seeds", ",".join(map(str, seeds)), "--length", str(length)]
    return cmd, {**os.environ, "PYTHONPATH": str(ROOT), "KVSCOPE_FAST_STEP": "off"}


def folder_bytes(folder: Path) -> int:
    """Bytes of every regular file in ``folder``'s shelves (page files and temporary ones), as ``du`` would."""
    total = 0
    for shelf in os.listdir(folder) if folder.is_dir() else ():
        if shelf.startswith("."):
            continue
        try:
            names = os.listdir(folder / shelf)
        except OSError:
            continue
        for name in names:
            try:
                total += os.lstat(folder / shelf / name).st_size
            except OSError:
                pass  # evicted or renamed between the listing and its stat
    return total


def shared(folder: Path, budget: int, seeds: tuple[tuple[int, ...], ...], engine: Path = ROOT) -> dict:
    """Writers (one per entry of ``seeds``) on one folder at once, its size sampled until they end: the peak and
    final bytes, and what each wrote. ``engine``: the checkout whose engine they run (an older one, to compare)."""
    procs = []
    for s in seeds:
        cmd, env = command(folder, budget, s)
        env["PYTHONPATH"] = str(ROOT)  # this file; the engine package comes from the working directory, first
        procs.append(subprocess.Popen(cmd, cwd=engine, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    peak = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, folder_bytes(folder))
        time.sleep(0.002)
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    runs = [json.loads(o.splitlines()[-1]) for o, _ in outs]
    final = folder_bytes(folder)
    return {"peak": max(peak, final), "final": final, "budget": budget,
            "written": [r["stats"].get("pages_written", 0) for r in runs], "runs": runs}


def spawn(folder, budget: int = 4 << 30, seeds=(0,), length: int = 200, timeout: float = 180.0) -> dict:
    """A ``run`` process to its end (``timeout``: a guard, so a blocked one cannot hang the caller): its JSON
    and its wall time."""
    cmd, env = command(folder, budget, seeds, length)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return {**json.loads(p.stdout.splitlines()[-1]), "wall_s": time.perf_counter() - t0}


def table(repeats: int = 3) -> str:
    """The tamper table: each case ``repeats`` times on a fresh copy (times: the fastest run, as the machine is
    shared; RSS: the largest), against a clean reader and a run without the tier (every token prefilled)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "clean"
        spawn(base)  # writes the 13 pages
        raw = chain_paths(base, prompt_ids())[5].read_bytes()
        want = spawn(None)["chats"][0]["tokens"]
        runs = {"clean reader (no tampering)": _best([(spawn(_copy(base, Path(tmp) / f"c{i}")), True)
                                                      for i in range(repeats)]),
                "no tier (all prefilled)": _best([(spawn(None), True) for _ in range(repeats)])}
        for name, (tamper, words, gone) in CASES.items():
            runs[name] = _best([_one(base, Path(tmp) / f"{name.replace(' ', '_')}{i}", tamper, raw, words, gone,
                                     want) for i in range(repeats)])
    clean = runs["clean reader (no tampering)"][0]
    rows = ["| case | handled cleanly | peak RSS MiB (× clean) | chat ms (× clean) | process s (× clean) |",
            "|---|---|---|---|---|"]
    for name, (r, ok) in runs.items():
        rows.append(f"| {name} | {'yes' if ok else 'NO'} | {r['rss_mib']:.0f} ({r['rss_mib'] / clean['rss_mib']:.2f}) "
                    f"| {r['ms']:.0f} ({r['ms'] / clean['ms']:.2f}) | {r['wall_s']:.2f} "
                    f"({r['wall_s'] / clean['wall_s']:.2f}) |")
    n_ok = sum(ok for name, (_, ok) in runs.items() if name in CASES)
    return "\n".join(rows) + f"\n\nhandled cleanly: {n_ok} / {len(CASES)}"


def _one(base: Path, folder: Path, tamper, raw: bytes, words: str, gone: bool, want: list[int]) -> tuple[dict, bool]:
    """A reader on a tampered copy of ``base``: its run, and whether it handled the case cleanly (the clean
    reply, pages 0-4 restored, the note, the page path as expected)."""
    _copy(base, folder)
    scratch = folder.with_name(folder.name + "-scratch")
    scratch.mkdir()
    page = chain_paths(folder, prompt_ids())[5]
    tamper(page, raw, scratch)
    try:
        got = spawn(folder, timeout=120)
    except subprocess.TimeoutExpired:
        return {"ms": float("nan"), "rss_mib": float("nan"), "wall_s": 120.0}, False
    finally:
        shutil.rmtree(scratch)
    c = got["chats"][0]
    return got, (c["tokens"] == want and c["restored"] == 5 * P and any(words in n for n in c["notes"])
                 and replaced(page) == gone)


def _best(runs: list[tuple[dict, bool]]) -> tuple[dict, bool]:
    return ({"ms": min(r["ms"] for r, _ in runs), "wall_s": min(r["wall_s"] for r, _ in runs),
             "rss_mib": max(r["rss_mib"] for r, _ in runs)}, all(ok for _, ok in runs))


def replaced(page: Path) -> bool:
    """Whether the page path holds a page file again (the tampered thing removed, the page written anew)."""
    return page.is_file() and not page.is_symlink() and page.read_bytes().startswith(MAGIC)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["run", "table", "shared"])
    ap.add_argument("--engine", default=str(ROOT), help="shared: the checkout whose engine the writers run")
    ap.add_argument("folder", nargs="?", default="")
    ap.add_argument("--budget", type=int, default=4 << 30)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--length", type=int, default=200)
    a = ap.parse_args()
    if a.what == "table":
        print(table())
        return
    if a.what == "shared":  # two writers, 3 chats of 13 pages each, a budget of 10 pages
        page = 20_800
        with tempfile.TemporaryDirectory() as tmp:
            r = shared(Path(tmp) / "kv", 10 * page, ((1, 2, 3), (4, 5, 6)), Path(a.engine))
        print(f"budget {r['budget']:,} B; peak {r['peak']:,} B ({r['peak'] / r['budget']:.2f}x, "
              f"{(r['peak'] - r['budget']) / page:+.1f} pages); final {r['final']:,} B; pages written {r['written']}")
        return
    print(json.dumps(run(a.folder or None, a.budget, [int(s) for s in a.seeds.split(",")], a.length)))


if __name__ == "__main__":
    main()
