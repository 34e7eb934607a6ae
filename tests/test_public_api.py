"""Tests, scripts, examples and the applications use InferScale through its public names only.

What a test needs to see inside (a request's preparation, what it staged, a cache's size) or to
make happen (a stuck encoder, a preemption) is in :mod:`inferscale_engine.testing` and
:mod:`inferscale_integrations.testing`; everything else is the serving API. Read statically
(``ast``): an attribute ``x._name`` of anything but ``self``, ``cls`` or ``super()``, a private
name given to ``getattr``/``setattr``/``monkeypatch.setattr``..., a dotted path into our packages
with a private part (``mock.patch("inferscale_engine.engine._x")``), and an import of a private
module or name of our packages each count.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("tests", "scripts", "examples", "inferscale_apps")
OURS = ("inferscale_engine", "inferscale_integrations", "inferscale_apps")
ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}

#: Private reaches that stay, as (file, what), each with its reason. Never add one to make the
#: test pass where :mod:`inferscale_engine.testing` could name what is needed.
ALLOWED: dict[tuple[str, str], str] = {}
#: Whole files that measure the library's private code paths themselves: their internals are
#: what they time (each wraps or drives private methods), so no public name could stand in.
ALLOWED_FILES: dict[str, str] = {
    "scripts/bench_table_build.py": "times the connector's per-span Python (ConnectorWorker._inject, the "
    "scheduler's claimed/planned state) with no vLLM behind it",
    "scripts/h200_profile.py": "wraps private methods (ConnectorWorker._inject, InferScaleEngine._prepare...) "
    "to time them inside a GPU request",
    "scripts/h200_hosttier.py": "wraps the tiers' and the connector's private methods to time a host-tier request",
    "scripts/h200_promote.py": "wraps the tiers' private methods and DMA copiers to time a promotion per method",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def _dotted_private(text: str) -> bool:
    """``text`` is a dotted path into our packages with a private part."""
    return bool(re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", text)) and _is_ours(text) and any(
        _private(part) for part in text.split("."))


def _exempt_owner(node: ast.expr) -> bool:
    """``self._x``, ``cls._x`` and ``super()._x``: a class's own members, which a test's
    subclass (of a framework's model, say) may override and call."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_reaches(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every reach into a private name in ``source``, in line order."""
    return sorted(_reaches(source), key=lambda found: found[0])


def _reaches(source: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _exempt_owner(node.value):
            yield node.lineno, f"{ast.unparse(node.value)}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _is_ours(node.module):
            if any(_private(part) for part in node.module.split(".")):
                yield node.lineno, f"from {node.module} import ..."
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_ours(alias.name) and any(_private(part) for part in alias.name.split(".")):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            args = node.args
            if name in ATTRIBUTE_FUNCTIONS and len(args) >= 2 and isinstance(args[1], ast.Constant) \
                    and isinstance(args[1].value, str) and _private(args[1].value) and not _exempt_owner(args[0]):
                yield node.lineno, f"{name}({ast.unparse(args[0])}, {args[1].value!r})"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _dotted_private(node.value):
            yield node.lineno, repr(node.value)


def _scanned_files() -> list[Path]:
    return [p for root in SCANNED for p in sorted((ROOT / root).rglob("*.py"))]


def test_the_scan_finds_each_kind_of_reach() -> None:
    """Positive control: each form the check looks for is found, the exempt ones are not."""
    source = '''
import inferscale_integrations._common
from inferscale_integrations import _common
from inferscale_engine.engine import _fingerprint, InferScaleEngine
from inferscale_engine import __version__
from test_server import _free_port
engine._prepare([], "u")
monkeypatch.setattr(engine, "_memory", None)
monkeypatch.setattr("inferscale_engine.engine._fingerprint", None)
self._x, cls._y, super()._generate(), engine.__dict__
'''
    found = [what for _, what in private_reaches(source)]
    assert found == [
        "import inferscale_integrations._common",
        "from inferscale_integrations import _common",
        "from inferscale_engine.engine import _fingerprint",
        "engine._prepare",
        "setattr(engine, '_memory')",
        "'inferscale_engine.engine._fingerprint'",
    ], found


def test_tests_scripts_and_apps_reach_no_private_name() -> None:
    files = _scanned_files()
    assert len(files) > 50  # the scan sees the trees it should
    found, used = [], set()
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED_FILES:
            used.add(rel)
            continue
        for line, what in private_reaches(path.read_text()):
            if (rel, what) in ALLOWED:
                used.add((rel, what))
            else:
                found.append(f"{rel}:{line}: {what}")
    assert not found, ("private names reached from outside the library; use the public API or "
                       "inferscale_engine.testing / inferscale_integrations.testing:\n" + "\n".join(found))
    stale = (set(ALLOWED) | set(ALLOWED_FILES)) - used
    assert not stale, f"allowed reaches no longer there (remove them): {sorted(map(str, stale))}"
