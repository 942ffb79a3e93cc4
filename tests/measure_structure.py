"""The structure's numbers, for a checkout at ROOT (default: this one): what the structure review counts.

    python tests/measure_structure.py [ROOT] [--list]

- files over 400 lines and functions over 60 (``app/`` and ``engine/``);
- rooms (``app.X`` / ``engine.X``, the top modules of a package counted as the package's own room) that import each
  other, and the cycles among them;
- cross-object private reach-ins: ``something._name`` where ``something`` is not ``self`` / ``cls`` and the name is
  defined in our own code (a library's private name is counted apart);
- dead definitions (a module-level function, class or constant no other file names) and test-only ones (only
  tests name it);
- reaches through a part in ``engine/core``: ``self.a.b.c``, an object reaching through its part ``a`` to a third
  object's member (also through a local name for ``self.a`` or ``self.a.b``); reads of frozen records count too;
- lines of C / C++ held in Python strings.

Name-based (a definition counts as used where its name appears as a word in another file): a lower bound for dead
code, an upper bound for nothing. ``--list`` prints what each number counts.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOMS = ("app", "engine")  # packages measured
_C_HINTS = re.compile(r"#include|__m256|__m512|static inline|\bint64_t\b|#define ")


def part_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, chain) of each reach through a part to a third object's member in ``tree``'s functions (see the
    module doc): a chain's third step counted once, whatever follows it."""
    out = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        nodes = [n for b in (fn.body if isinstance(fn.body, list) else [fn.body]) for n in ast.walk(b)]
        depth: dict[str, int] = {}  # local names for ``self``'s parts: how far from ``self`` each stands

        def steps(e) -> int | None:
            if isinstance(e, ast.Name):
                return 0 if e.id == "self" else depth.get(e.id)
            if isinstance(e, ast.Attribute):
                d = steps(e.value)
                return None if d is None else d + 1
            return None

        for n in sorted((n for n in nodes if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
            for t in n.targets:
                pairs = [(t, n.value)] if isinstance(t, ast.Name) else list(zip(t.elts, n.value.elts)) \
                    if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple) and len(t.elts) == len(n.value.elts) \
                    else []
                for name, value in pairs:
                    d = steps(value)
                    if isinstance(name, ast.Name) and name.id != "self" and d:
                        depth[name.id] = d
        out |= {(n.lineno, ast.unparse(n)) for n in nodes if isinstance(n, ast.Attribute) and steps(n) == 3}
    return sorted(out)


def _files(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in ROOMS:
        for p in sorted((root / pkg).rglob("*.py")):
            out[".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = p
    return out


def room_of(module: str) -> str:
    """``engine.kv.paged.pool`` -> ``engine.kv``; a package's own top modules (``engine.config``, ``app.main``) are
    rooms of their own: the ground every room stands on, or the entry point above them all."""
    return ".".join(module.split(".")[:2])


def _imports(module: str, tree: ast.AST, known: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:-node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names} & known
            found |= subs or {mod}
    return {m for m in found if m.split(".")[0] in ROOMS}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (the import test's Tarjan), each sorted."""
    from test_imports import _cycles as components  # (tests/ is this script's own directory on sys.path)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    return [sorted(c) for c in components(graph)]


def _c_lines(tree: ast.AST) -> int:
    return sum(node.value.count("\n") + 1 for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 200
               and len(_C_HINTS.findall(node.value)) >= 2)


def measure(root: Path) -> dict:
    files = _files(root)
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in files.items()}
    texts = {m: p.read_text(encoding="utf-8") for m, p in files.items()}
    tests = {p: p.read_text(encoding="utf-8") for p in (root / "tests").rglob("*.py")} if (root / "tests").is_dir() else {}
    long_files = sorted((len(texts[m].splitlines()), m) for m in files if len(texts[m].splitlines()) > 400)
    long_funcs = sorted((n.end_lineno - n.lineno + 1, f"{m}.{n.name}") for m, t in trees.items() for n in ast.walk(t)
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60)
    rooms: dict[str, set[str]] = defaultdict(set)
    for m, t in trees.items():
        for imp in _imports(m, t, set(files)):
            a, b = room_of(m), room_of(imp)
            if a != b and b in {room_of(x) for x in files}:
                rooms[a].add(b)
    mutual = sorted({tuple(sorted((a, b))) for a in rooms for b in rooms[a] if a in rooms.get(b, ())})
    ours = {n.name for t in trees.values() for n in ast.walk(t)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    ours |= {t.attr for tr in trees.values() for n in ast.walk(tr) if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    reach, library = [], []
    for m, t in trees.items():
        for n in ast.walk(t):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                v = n.value
                if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                    continue
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                    continue
                (reach if n.attr in ours else library).append(f"{m}:{n.lineno} .{n.attr}")
    words = defaultdict(set)
    for m, text in texts.items():
        for w in set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)):
            words[w].add(m)
    test_words = set()
    for text in tests.values():
        test_words |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    dead, test_only = [], []
    for m, t in trees.items():
        for n in t.body:
            names = [n.name] if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else \
                [x.id for x in getattr(n, "targets", []) if isinstance(x, ast.Name)] if isinstance(n, ast.Assign) else []
            for name in names:
                if name.startswith("__") or name in ("main",):
                    continue
                used_elsewhere = words[name] - {m}
                used_here = len(re.findall(rf"\b{re.escape(name)}\b", texts[m])) > 1
                if used_elsewhere or used_here:
                    continue
                (test_only if name in test_words else dead).append(f"{m}.{name}")
    cycles = _cycles({k: set(v) for k, v in rooms.items()})
    reaches = [f"{m}:{line} {chain}" for m, t in trees.items() if m.startswith("engine.core.")
               for line, chain in part_reaches(t)]
    return {"files_over_400": long_files, "functions_over_60": long_funcs, "room_pairs_importing_each_other": mutual,
            "room_cycles": cycles, "private_reach_ins": reach, "library_private_uses": library, "dead": dead,
            "test_only": test_only, "part_reaches_core": reaches,
            "c_lines_in_python_strings": sum(_c_lines(t) for t in trees.values())}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    root = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    r = measure(root)
    for key, value in r.items():
        count = value if isinstance(value, int) else len(value)
        print(f"{key}: {count}")
        if "--list" in sys.argv and not isinstance(value, int):
            for v in value:
                print(f"    {v}")


if __name__ == "__main__":
    main()
