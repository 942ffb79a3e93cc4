"""The import contract in ``pyproject.toml`` (``[tool.kvscope.imports]``), checked on the source: every import
statement of every module, at the top or inside a function (``TYPE_CHECKING`` blocks aside), so a lazy import
cannot hide a layer crossing or a cycle. Also: the model runner is the only code that calls a model forward."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")


def contract() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["kvscope"]["imports"]


def modules(*packages: str) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports_of(name: str, path: Path, known: set[str] | None = None) -> set[str]:
    """Dotted names ``path`` imports (``from a import b`` gives ``a.b`` when that is a module, else ``a``)."""
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                return  # annotations only: not an import at run time
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                parts = name.split(".")
                base = parts[:len(parts) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names} & (known or set())
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(mod)

    Visitor().visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("rule", contract()["forbidden"], ids=lambda r: r["source"])
def test_forbidden_imports(rule):
    mods = modules("engine", "app")
    bad = [f"{m} imports {imp}" for m, p in mods.items() if _under(m, rule["source"])
           for imp in sorted(imports_of(m, p, set(mods))) if any(_under(imp, f) for f in rule["imports"])]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", contract()["acyclic"])
def test_no_import_cycles(package):
    mods = modules(package)
    graph = {m: imports_of(m, p, set(mods)) & set(mods) - {m} for m, p in mods.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" ↔ ".join(sorted(c)) for c in cycles)


def room_of(module: str) -> str:
    """``engine.kv.paged.pool`` -> ``engine.kv``; a package's top modules (``engine.config``, ``app.main``) are rooms
    of their own."""
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("package", contract()["acyclic-rooms"])
def test_no_room_cycles(package):
    """Rooms, not only modules: ``app.link`` importing ``app.controls`` while ``app.controls`` imports ``app.link``
    is a cycle even where no two modules import each other."""
    mods = modules(package)
    graph: dict[str, set[str]] = {room_of(m): set() for m in mods}
    for m, p in mods.items():
        graph[room_of(m)] |= {room_of(i) for i in imports_of(m, p, set(mods)) & set(mods)} - {room_of(m)}
    cycles = _cycles(graph)
    assert not cycles, "room cycles: " + "; ".join(" ↔ ".join(sorted(c)) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan); an edge to a module with no entry of its
    own leads nowhere (``tests/measure_structure.py`` finds the rooms' cycles with it too)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_only_the_runner_calls_the_model():
    """One place runs the model: a forward call (``model(input_ids=...)``) appears in ``engine/model/runner.py`` only
    (``engine/model/arch.py`` probes a model once at load and ``engine/tools/bench.py`` times HF's own ``generate``)."""
    allowed = {"engine.model.runner"} | set(contract()["model-call-exempt"])
    calls = []
    for m, p in modules("engine").items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and any(k.arg == "input_ids" for k in node.keywords):
                f = node.func
                callee = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if "model" in callee.lower() and m not in allowed:
                    calls.append(f"{m}:{node.lineno}")
    assert not calls, calls


def test_the_checker_sees_a_lazy_cycle(tmp_path, monkeypatch):
    """The checker itself: a cycle through an import inside a function is found."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    mods = modules("pkg")
    graph = {m: imports_of(m, p, set(mods)) & set(mods) - {m} for m, p in mods.items()}
    assert [sorted(c) for c in _cycles(graph)] == [["pkg.a", "pkg.b"]]


def test_the_checker_sees_a_room_cycle(tmp_path, monkeypatch):
    """The room check itself: two rooms whose modules import each other's other modules form a cycle."""
    for room in ("a", "b"):
        (tmp_path / "pkg" / room).mkdir(parents=True)
        (tmp_path / "pkg" / room / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a" / "x.py").write_text("from pkg.b import y\n")
    (tmp_path / "pkg" / "b" / "y.py").write_text("")
    (tmp_path / "pkg" / "b" / "z.py").write_text("def f():\n    import pkg.a.w\n")
    (tmp_path / "pkg" / "a" / "w.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="room cycles: pkg.a ↔ pkg.b"):
        test_no_room_cycles("pkg")
