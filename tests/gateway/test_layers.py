"""The dependencies point one way: no import circle among proxy's modules nor the load tester's,
and the pure packages (the policies and what they believe, what the servers are and what their
engines say) import nothing that does network or async I/O, directly or through another module."""

from __future__ import annotations

import ast
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "proxy"
# Pure: what routing decides with (the policies, the steps of the decision, what servers are).
# Nothing here may reach a socket, the event loop or a framework.
PURE = ("proxy.policy", "proxy.fleet", "proxy.routing.steps")
IO = ("asyncio", "socket", "ssl", "httptools", "uvicorn", "uvloop", "fastapi", "starlette", "aiohttp", "httpx")


def package_graph(root: Path, outside: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """For each module of the package at `root` (its subpackages too, dotted from it): the modules of
    the package it imports, relative or absolute, those under TYPE_CHECKING included (a circle
    only types need is still one the reader must hold in mind); into `outside`, where given, the
    other top-level packages each imports."""
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
            if outside is not None:
                outside.setdefault(name, set()).update(t.split(".")[0] for t in targets if t and not t.startswith(top))
        graph[name] = found
    return graph


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_no_import_circle_in_the_gateway() -> None:
    graph = package_graph(PROXY)
    assert graph.get("proxy.routing.router")  # the walk reads the subpackages
    circles = sorted(m for m in graph if m in reaches(graph, m))
    assert not circles, f"gateway modules in an import circle: {circles}"


def test_no_import_circle_in_the_load_tester() -> None:
    graph = package_graph(PROXY.parent / "loadtest")
    assert graph.get("loadtest.stats")
    circles = sorted(m for m in graph if m in reaches(graph, m))
    assert not circles, f"load tester modules in an import circle: {circles}"


def test_the_pure_packages_do_no_io() -> None:
    """A pure package's modules reach only pure modules, and none of them an I/O library."""
    outside: dict[str, set[str]] = {}
    graph = package_graph(PROXY, outside)
    pure = [m for m in graph if m.startswith(PURE)]
    assert len(pure) > 10
    for m in pure:
        below = reaches(graph, m)
        impure = sorted(n for n in below if not n.startswith(PURE) and n != "proxy")
        assert not impure, f"{m} imports {impure}, which are not pure"
        for n in {m} | below:
            io = outside.get(n, set()) & set(IO)
            assert not io, f"{m} reaches {n}, which imports {sorted(io)}"


def test_the_walk_sees_io_and_circles(tmp_path: Path) -> None:
    """The checks above can fail: a made-up package with a circle and an I/O import is caught."""
    pkg = tmp_path / "proxy"
    (pkg / "policy").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "policy" / "__init__.py").write_text("")
    (pkg / "policy" / "a.py").write_text("import asyncio\nfrom .b import x\n")
    (pkg / "policy" / "b.py").write_text("from ..policy.a import y\nx = 1\n")
    outside: dict[str, set[str]] = {}
    graph = package_graph(pkg, outside)
    assert "proxy.policy.a" in reaches(graph, "proxy.policy.a")
    assert "asyncio" in outside["proxy.policy.a"]


def test_the_command_sits_above_both_packages() -> None:
    """`specgate/` calls into the gateway and the load tester; neither imports it back, and the
    gateway never imports the load tester (the image runs it without the load tester's extras)."""
    for root in (PROXY, PROXY.parent / "loadtest"):
        outside: dict[str, set[str]] = {}
        package_graph(root, outside)
        assert outside, root
        assert not [m for m, tops in outside.items() if "specgate" in tops], f"{root.name} imports specgate"
        if root == PROXY:
            assert not [m for m, tops in outside.items() if "loadtest" in tops], "proxy imports loadtest"
