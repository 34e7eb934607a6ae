"""Every error InferScale defines is an InferScaleError, and keeps the builtin base callers catch."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from inferscale_engine import errors
from inferscale_engine.errors import InferScaleError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inferscale_engine", "inferscale_integrations", "inferscale_apps")
_BUILTIN_ERRORS = {
    name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)
}
#: Error classes allowed outside errors.py without InferScaleError: shrink, never grow.
ALLOWED = {
    # The server's HTTP response carrier (status + OpenAI error body), raised and caught inside
    # the app, never seen by library callers.
    ("inferscale_apps/server/errors.py", "APIError"),
    # SIGTERM raised in the CLI's main thread, as Ctrl-C raises KeyboardInterrupt: a signal, not
    # an error; a BaseException so that no ``except Exception`` on the way stops the shutdown.
    ("inferscale_apps/cli.py", "_Terminated"),
}


def test_every_error_in_errors_py_is_an_inferscale_error() -> None:
    classes = [obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, BaseException)]
    assert len(classes) > 10
    for cls in classes:
        assert issubclass(cls, InferScaleError), cls


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("KVMissingError", LookupError),
        ("ModelNotFoundError", ValueError),
        ("ModelPreparationError", RuntimeError),
        ("ConnectorError", RuntimeError),
        ("EngineClosedError", RuntimeError),
        ("FactNotFoundError", LookupError),
    ],
)
def test_builtin_bases_kept(name: str, builtin: type[BaseException]) -> None:
    assert issubclass(getattr(errors, name), builtin)


def test_reexported_where_they_were_defined() -> None:
    from inferscale_engine import models
    from inferscale_engine.memory.kv import tiers

    assert tiers.KVMissingError is errors.KVMissingError
    assert models.ModelNotFoundError is errors.ModelNotFoundError
    assert models.ModelPreparationError is errors.ModelPreparationError


def test_no_error_class_defined_outside_errors_py() -> None:
    """An exception class elsewhere would escape ``except InferScaleError`` (checked statically:
    a class whose bases name a builtin exception)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "inferscale_engine/errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id in _BUILTIN_ERRORS for b in node.bases
                ):
                    found.append((rel, node.name))
    assert set(found) == ALLOWED, f"error classes not derived from InferScaleError: {sorted(set(found) - ALLOWED)}"
