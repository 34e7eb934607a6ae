"""What a new user meets in the first hour (issue 24): quiet output, fast store-only commands,
clear answers to mistakes. Fresh processes where import side effects are the point."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_py(code: str, *, unset: tuple[str, ...] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
        env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, check=False,
    )


def test_store_only_commands_never_import_vllm(tmp_path):
    r = run_py(f"""
        import sys
        from inferscale_apps.cli import main
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
            [sys.executable, "-m", "inferscale_apps.cli", "memory", "list", "--user", "u", "--store", str(store)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, check=False,
        )
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 1
    err = " ".join(r.stderr.split())  # the CLI wraps long messages
    assert f"by process {holder.pid}" in err, err
    assert "--server URL" in err and "/v1/memories/" in err, err  # the way to reach a server's store


def test_library_use_prints_no_vllm_logs_to_stdout(smollm2_path, tmp_path):
    # The README's snippet in a fresh process: stdout carries the program's output only.
    r = run_py(f"""
        from inferscale_engine import InferScaleEngine
        with InferScaleEngine(model={smollm2_path!r}, store_path={str(tmp_path / "store")!r}, max_model_len=1024) as e:
            e.memory.add("My dog is called Rex.", user_id="u")
            e.memory.wait_for_encoding()
            print("REPLY", e.generate("Hello", user_id="u", max_tokens=4).text)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("REPLY"), r.stdout
    assert not any(level in r.stderr for level in (" INFO ", " WARNING ")), r.stderr[-3000:]
    # nor loading bars (vLLM's weight shards, the embedder's "Loading weights")
    assert "Loading" not in r.stderr and "it/s]" not in r.stderr, r.stderr[-3000:]


def test_verbose_switch_gives_vllm_its_defaults_back():
    r = run_py("""
        import logging, os
        import inferscale_engine  # noqa: F401  (quiet from the first import)
        from inferscale_engine.logs import configure_vllm_logging, progress_bars
        print(os.environ.get("VLLM_LOGGING_LEVEL"), os.environ.get("VLLM_LOGGING_STREAM"), progress_bars())
        root = logging.getLogger(); before = (root.level, list(root.handlers))
        import vllm.logger  # noqa: F401
        configure_vllm_logging(verbose=True)
        print(os.environ.get("VLLM_LOGGING_LEVEL"), logging.getLogger("vllm").level, progress_bars())
        print((root.level, list(root.handlers)) == before)
    """, unset=("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "INFERSCALE_VERBOSE"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["ERROR ext://sys.stderr False", f"None {logging.INFO} True", "True"]


def _classes():
    from inferscale_integrations.langchain import ChatInferScale, InferScaleMemory, InferScaleRetriever
    from inferscale_integrations.langchain import InferScaleLLM as LangChainLLM
    from inferscale_integrations.llamaindex import InferScaleLLM as LlamaIndexLLM
    from inferscale_integrations.llamaindex import InferScaleMemory as LlamaIndexMemory

    return [ChatInferScale, LangChainLLM, InferScaleMemory, InferScaleRetriever, LlamaIndexLLM, LlamaIndexMemory]


def test_misspelled_arguments_are_rejected_with_the_closest_name():
    import pytest

    for cls in _classes():
        with pytest.raises(ValueError, match=r"unknown argument 'max_token'") as err:
            cls(model="smollm2", user_id="a", max_token=10)
        assert cls.__name__ in str(err.value)
    from inferscale_integrations.langchain import ChatInferScale

    with pytest.raises(ValueError, match=r"did you mean 'max_tokens'"):
        ChatInferScale(model="smollm2", user_id="a", max_token=10)
    with pytest.raises(ValueError, match=r"did you mean 'user_id'"):
        ChatInferScale(model="smollm2", userid="a")


def test_a_missing_user_id_warns_once_per_class():
    import warnings

    from inferscale_engine.errors import SharedUserWarning
    from inferscale_engine.types import DEFAULT_USER
    from inferscale_integrations.langchain import ChatInferScale, InferScaleChatMessageHistory
    from inferscale_integrations.testing import forget_shared_user_warnings

    forget_shared_user_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ChatInferScale(model="smollm2")
        ChatInferScale(model="smollm2")
        ChatInferScale(model="smollm2", user_id="alice")
        history = InferScaleChatMessageHistory(model="smollm2")
    shared = [w for w in caught if issubclass(w.category, SharedUserWarning)]
    assert [str(w.message).split()[0] for w in shared] == ["ChatInferScale", "InferScaleChatMessageHistory"]
    assert "pass user_id=" in str(shared[0].message)
    assert history.user_id == DEFAULT_USER


def test_handles_sent_to_another_langchain_model_warn_once():
    import warnings

    import pytest
    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    import inferscale_integrations.langchain  # noqa: F401  (registers the guard)

    handle = "<<mem:" + "a" * 16 + ":" + "b" * 16 + ">>"
    llm = FakeListChatModel(responses=["ok", "ok", "ok"])
    with pytest.warns(UserWarning, match=r"FakeListChatModel received memory handles .*HandleExpander"):
        llm.invoke(f"You remember:\n{handle}\nWhat is my dog's name?")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.invoke(f"again {handle}")  # once per model class
        llm.invoke("no handle here")


def test_handles_sent_to_another_llamaindex_llm_warn_once():
    import warnings

    import pytest
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.llms import MockLLM

    import inferscale_integrations.llamaindex  # noqa: F401  (registers the guard)

    handle = "<<mem:" + "c" * 16 + ":" + "d" * 16 + ">>"
    llm = MockLLM(max_tokens=4)
    with pytest.warns(UserWarning, match=r"MockLLM received memory handles .*expand_handles"):
        llm.chat([ChatMessage(role="system", content=f"You remember:\n{handle}"), ChatMessage(role="user", content="Hi")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.complete(f"again {handle}")  # once per LLM class
