"""What a new user meets in the first hour (issue 24): quiet output, fast store-only commands,
clear answers to mistakes. Fresh processes where import side effects are the point."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_py(code: str, *, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, cwd=ROOT, check=False,
    )


def test_store_only_commands_never_import_vllm(tmp_path):
    r = run_py(f"""
        import sys
        from inferscale_engine.cli import main
        store = {str(tmp_path / "store")!r}
        assert main(["memory", "list", "--user", "u", "--store", store]) == 0
        assert main(["memory", "search", "--user", "u", "--store", store, "where do I live?"]) == 0
        assert main(["memory", "delete", "--user", "u", "--store", store, "--all"]) == 0
        print("vllm imported:", "vllm" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vllm imported: False" in r.stdout


def test_locked_store_names_the_holder(tmp_path):
    store = tmp_path / "store"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from inferscale_engine.memory import MemoryStore; "
         "s = MemoryStore(None, sys.argv[1]); print('open', flush=True); time.sleep(120)", str(store)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        r = subprocess.run(
            [sys.executable, "-m", "inferscale_engine.cli", "memory", "list", "--user", "u", "--store", str(store)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, check=False,
        )
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 1
    err = " ".join(r.stderr.split())  # the CLI wraps long messages
    assert f"by process {holder.pid}" in err, err
    assert "/v1/memories/" in err, err
