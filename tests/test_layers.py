"""The dependencies point one way: no import circle among proxy's modules nor the load tester's, and
the policy modules (the rule, the adaptive estimate, the evidence, what servers are and what a
reading says) import nothing that does network or async I/O, directly or through another proxy
module."""

from __future__ import annotations

import ast
from pathlib import Path

PROXY = Path(__file__).resolve().parent.parent / "proxy"
# Pure: what routing decides with. Nothing here may reach a socket, the event loop or a framework.
POLICY = (
    "policy", "adaptive", "speedmodel", "evidence", "forecast", "servers", "readings", "topology", "calibration",
    "engines", "promtext",
)  # fmt: skip
IO = ("asyncio", "socket", "ssl", "httptools", "uvicorn", "uvloop", "fastapi", "starlette", "aiohttp", "httpx")


def imports() -> dict[str, tuple[set[str], set[str]]]:
    """For each proxy module: the proxy modules and the other top-level packages it imports."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    names = {p.stem for p in PROXY.glob("*.py")}
    for path in PROXY.glob("*.py"):
        ours: set[str] = set()
        theirs: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    ours.add(node.module.split(".")[0])
                else:
                    ours.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                theirs.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                theirs.update(a.name.split(".")[0] for a in node.names)
        out[path.stem] = (ours & names, theirs)
    return out


def reach(graph: dict[str, tuple[set[str], set[str]]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph[m][0]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_no_import_circle() -> None:
    graph = imports()
    circles = sorted(m for m in graph if m in reach(graph, m))
    assert not circles, f"modules in an import circle: {circles}"


def test_the_policy_modules_do_no_io() -> None:
    graph = imports()
    for m in POLICY:
        below = reach(graph, m)
        assert below <= set(POLICY), f"{m} imports {sorted(below - set(POLICY))}, which are not pure"
        for n in {m} | below:
            io = graph[n][1] & set(IO)
            assert not io, f"{m} reaches {n}, which imports {sorted(io)}"


def package_graph(root: Path) -> dict[str, set[str]]:
    """For each module of the package at `root` (its subpackages too, dotted from it): the modules of
    the package it imports, relative or absolute, those under TYPE_CHECKING included (a circle
    only types need is still one the reader must hold in mind)."""
    top = root.name
    modules: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                at = ".".join(p for p in (base, node.module or "") if p)
                # `from .pkg import mod` is the module; `from .mod import name` the module it is in.
                targets = [f"{at}.{a.name}" if f"{at}.{a.name}" in modules else at for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            found.update(t for t in targets if t in modules and t != name and t.startswith(top))
        graph[name] = found
    return graph


def test_no_import_circle_in_the_load_tester() -> None:
    graph = package_graph(PROXY.parent / "loadtest")
    assert graph.get("loadtest.stats")  # the walk reads the package

    def reaches(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for n in graph[todo.pop()] - seen:
                seen.add(n)
                todo.append(n)
        return seen

    circles = sorted(m for m in graph if m in reaches(m))
    assert not circles, f"load tester modules in an import circle: {circles}"
