"""Our packages' imports form no cycle, and the library never imports the apps.

Read statically (``ast``), so it costs no vLLM or torch import: an edge is an import of one of
our modules anywhere in another, at module level or inside a function. An import inside a
function only defers the cycle to the first call (it is still two layers that each know the
other), so it counts. ``if TYPE_CHECKING:`` blocks never run, so they do not count here; a second
check counts them too: a cycle there is no import error, but it is still two layers that each
know the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("inferscale_engine", "inferscale_integrations")
APPS = "inferscale_apps"
PACKAGES = (*LIBRARY, APPS)

#: Known cycles, as the edges (importer, imported) that close them. Each is a debt: remove the
#: edge here when the cycle is gone (the test says so), never add one to make the test pass.
ALLOWED_EDGES: set[tuple[str, str]] = set()
#: The same, counting imports under ``if TYPE_CHECKING:``.
ALLOWED_TYPE_EDGES: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt], type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``body``, in nested blocks, classes and functions too;
    ``if TYPE_CHECKING:`` blocks only with ``type_checking``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            if type_checking:
                yield from _imports(node.body, type_checking)
            yield from _imports(node.orelse, type_checking)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _imports([child], type_checking)
                elif isinstance(child, (ast.ExceptHandler, ast.match_case)):
                    yield from _imports(child.body, type_checking)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                yield alias.name
        return
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        # `from package import name` imports the submodule if there is one, else the package.
        sub = f"{base}.{alias.name}"
        if sub in known:
            yield sub
        elif base in known:
            yield base


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {
            target
            for node in _imports(tree.body, type_checking)
            for target in _targets(node, name, is_package, known)
            if target != name
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "inferscale_engine.engine" in graph
    assert "inferscale_engine.vllm_compat" in graph["inferscale_engine.engine"]
    assert "inferscale_engine.kv" in graph["inferscale_engine.engine"]
    # engine.memory imports the store where it builds it: an import inside a function is an edge.
    assert "inferscale_engine.memory" in graph["inferscale_engine.engine"]
    # Only for type checking: the store's value types name the KV in annotations.
    assert "inferscale_engine.kv" not in graph["inferscale_engine.types"]
    assert "inferscale_engine.kv" in import_graph(type_checking=True)["inferscale_engine.types"]


def test_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _check_acyclic(graph: dict[str, set[str]], allowed: set[tuple[str, str]]) -> None:
    for importer, imported in sorted(allowed):
        assert imported in graph.get(importer, set()), (
            f"allowed edge {importer} -> {imported} is gone: remove it from the allow-list")
        graph[importer].discard(imported)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycles() -> None:
    _check_acyclic(import_graph(), ALLOWED_EDGES)


def test_no_import_cycles_counting_type_checking_imports() -> None:
    _check_acyclic(import_graph(type_checking=True), ALLOWED_TYPE_EDGES)


def _importing(importers: str | tuple[str, ...], package: str) -> list[tuple[str, str]]:
    """(module, import) for each import of ``package`` anywhere in a module whose name starts
    with ``importers``, at module level or inside a function."""
    found = []
    for name, path in _modules().items():
        if not name.startswith(importers):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(name, a.name) for a in node.names if a.name.split(".")[0] == package]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
                found.append((name, node.module or ""))
    return found


def test_the_library_never_imports_the_applications() -> None:
    """The CLI, chatbot, server and benchmarks sit on the library, never inside it: no import of
    ``inferscale_apps`` anywhere in the library, at module level or inside a function."""
    found = _importing(LIBRARY, APPS)
    assert not found, f"library modules importing applications: {found}"


def test_the_server_never_imports_the_integrations() -> None:
    """The HTTP server sits on the engine alone: what it shares with the integrations (tool
    calling, prompting) lives in ``inferscale_engine``."""
    found = _importing(f"{APPS}.server", "inferscale_integrations")
    assert not found, f"server modules importing the integrations: {found}"


def test_the_store_never_imports_the_engine_layer() -> None:
    """``memory/`` sits below the engine: it names the engine only through its own protocols
    (``memory/encoding.py``) and shares with it only the modules below both (value types,
    errors, configuration, handles, the KV, the logging switches), counting ``TYPE_CHECKING``
    imports too."""
    below = {f"inferscale_engine.{m}" for m in ("config", "errors", "handles", "kv", "logs", "types")}
    found = sorted(
        (name, target)
        for name, targets in import_graph(type_checking=True).items()
        if name.startswith("inferscale_engine.memory")
        for target in targets
        if not target.startswith("inferscale_engine.memory") and target not in below
    )
    assert not found, f"memory modules importing above the store: {found}"


def test_memory_subpackages_import_one_way() -> None:
    """Inside ``memory/``, imports go one way: ``text`` ← ``meta`` ← ``kv`` ← the top-level
    modules (the store and what opens and follows it); each subpackage may also use the front
    door's leaf modules (``item``, ``validation``, ``encoding``), which import nothing of
    ``memory/``. Counts ``TYPE_CHECKING`` imports too, so a concept's package never knows one above."""
    memory = "inferscale_engine.memory"
    leaves = {f"{memory}.{m}" for m in ("item", "validation", "encoding")}
    below = {"text": {"text"}, "meta": {"text", "meta"}, "kv": {"text", "meta", "kv"}}
    graph = import_graph(type_checking=True)
    found = []
    for name, targets in graph.items():
        parts = name.split(".")
        for target in targets:
            if not target.startswith(f"{memory}."):
                continue
            inside = target.split(".")[2]
            if name in leaves:
                found.append((name, target))
            elif len(parts) > 3 and parts[:2] == ["inferscale_engine", "memory"] and parts[2] in below:
                if target not in leaves and inside not in below[parts[2]]:
                    found.append((name, target))
    assert not found, f"memory modules importing a layer above their own: {sorted(found)}"
