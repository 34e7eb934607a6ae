"""Engine lifecycle: build, close and rebuild an engine in one process (tiny random Llama, CPU).

vLLM keeps its parallel groups (TP/PP/world) and the KV connector in module globals, and its
in-process client tears them down from a ``weakref.finalize`` when it is garbage-collected. A
closed engine whose vLLM engine was still reachable (an exception's traceback, any reference
cycle) used to tear down the state of the *next* engine whenever the collector got to it:
inside that engine's construction ("tensor model parallel group is not initialized", seen when
test_memory_store.py ran before test_bench_quick.py) or while it served. ``close()`` now shuts
vLLM down itself, so collecting a closed engine later changes nothing.

That state is this process's only in-process mode (``multiprocess=False``), which these tests
run; a multiprocess engine keeps it in vLLM's own processes.
"""

from __future__ import annotations

import gc

import pytest

from inferscale_engine import InferScaleEngine, Span

pytestmark = pytest.mark.timeout(300)

OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "recompute": 0, "multiprocess": False}


def _build(model: str, store) -> InferScaleEngine:
    return InferScaleEngine(model=model, store_path=store, **OPTIONS)


def _process_state_is_live() -> bool:
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer import kv_transfer_state

    return parallel_state.model_parallel_is_initialized() and kv_transfer_state.has_kv_transfer_group()


def _serves_injected_kv(engine: InferScaleEngine) -> None:
    """An injected request goes through the KV connector; it must equal the prompt baseline."""
    fact = engine.tokenize("My dog is called Rex.")
    span = Span("lifecycle:rex", tuple(fact), engine.encode_fact(fact))  # at position 0: exact
    question = engine.tokenize(" What is my dog called?")
    injected = engine.generate_segments([span, question], max_tokens=4)
    plain = engine.generate_segments([span, question], max_tokens=4, mode="prompt")
    assert injected.usage.injected_tokens == len(fact)
    assert injected.token_ids == plain.token_ids and len(injected.token_ids) == 4


def test_rebuild_after_close_survives_collection_of_the_closed_engine(tiny_llama, tmp_path):
    first = _build(tiny_llama, tmp_path / "a")
    _serves_injected_kv(first)
    was_enabled = gc.isenabled()
    gc.disable()  # the collector runs only when vLLM runs it
    try:
        first.close()
        # Leave the closed engine reachable only through a reference cycle, as a traceback kept
        # after an exception does. vLLM's model loader calls gc.collect() after the next
        # engine's parallel groups exist and before its KV connector does: where the old
        # teardown struck.
        cycle: list = [first]
        cycle.append(cycle)
        del first, cycle
        second = _build(tiny_llama, tmp_path / "b")
    finally:
        if was_enabled:
            gc.enable()
    try:
        assert _process_state_is_live()
        _serves_injected_kv(second)
    finally:
        second.close()
    # The other timing: a closed engine still referenced while the next one is built, and
    # collected while that one serves.
    third = _build(tiny_llama, tmp_path / "c")
    try:
        del second
        gc.collect()
        assert _process_state_is_live()
        _serves_injected_kv(third)
    finally:
        third.close()
    assert not _process_state_is_live()  # close() itself released the process-global state


def test_settings_vllm_refuses_are_one_clear_error_and_leave_nothing_behind(tiny_llama, tmp_path):
    from probes import shm_segments

    from inferscale_engine.errors import EngineSettingsError

    segments = shm_segments()
    with pytest.raises(EngineSettingsError, match=r"max_model_len \(100000\) is greater than") as caught:
        InferScaleEngine(model=tiny_llama, store_path=tmp_path, **{**OPTIONS, "max_model_len": 100_000})
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no pydantic trace
    assert isinstance(caught.value, ValueError)  # what callers of a settings error catch
    assert shm_segments() == segments
    engine = _build(tiny_llama, tmp_path / "after")  # the failed start left the process usable
    try:
        _serves_injected_kv(engine)
    finally:
        engine.close()


def test_kv_transfer_config_is_refused_before_anything_starts(tiny_llama, tmp_path):
    from probes import shm_segments

    from inferscale_engine.errors import EngineSettingsError

    segments = shm_segments()
    with pytest.raises(EngineSettingsError, match="kv_transfer_config is InferScale's own"):
        InferScaleEngine(model=tiny_llama, store_path=tmp_path, kv_transfer_config={"kv_connector": "Other"}, **OPTIONS)
    assert shm_segments() == segments and not _process_state_is_live()


def test_prefix_caching_can_be_turned_off(tiny_llama, tmp_path, caplog):
    """A vLLM option the engine also sets (prefix caching) is the caller's to change; with the
    cache off there is nothing to keep injected prompts out of, and injection works as ever."""
    with caplog.at_level("INFO", logger="inferscale_engine.vllm_compat"):
        engine = InferScaleEngine(model=tiny_llama, store_path=tmp_path, enable_prefix_caching=False, **OPTIONS)
    try:
        assert "lacks the prefix-cache hooks" not in caplog.text
        _serves_injected_kv(engine)
        prompt = [engine.tokenize("A plain prompt, long enough to fill a cache block. " * 6)]
        engine.generate_segments(prompt, max_tokens=1, mode="prompt")
        assert engine.generate_segments(prompt, max_tokens=1, mode="prompt").usage.cached_tokens == 0
    finally:
        engine.close()


def test_unknown_engine_options_are_named_before_anything_starts(tiny_llama, tmp_path):
    from probes import shm_segments

    from inferscale_engine.errors import EngineSettingsError

    segments = shm_segments()
    with pytest.raises(EngineSettingsError, match=r"gpu_memory_utilisation \(did you mean gpu_memory_utilization\?\)"):
        InferScaleEngine(model=tiny_llama, store_path=tmp_path, gpu_memory_utilisation=0.5, **OPTIONS)
    assert shm_segments() == segments and not _process_state_is_live()
