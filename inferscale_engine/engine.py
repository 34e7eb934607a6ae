"""``InferScaleEngine``: a co-located vLLM engine that serves prompts with injected fact KV.

Flow of one request::

    prompt / chat messages ──render──▶ text with handles ──resolve──▶ segments
      [head ids][fact span][sep ids][fact span]...[tail ids]
    ──layout──▶ token ids + InjectionPlan (every token before the last fact comes from KV)
    ──vLLM request (kv_transfer_params, cache_salt)──▶ connector ──▶ paged KV cache

What the model sees is exactly the prompt with each handle replaced by its fact's token ids;
injection only changes how the KV of those tokens was computed. Text before the last handle
(the head and separators between facts) is encoded once and reused: the head at position 0
with no context (exact), separators after the head (an approximation like a fact at ``w=0``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import gc
import hashlib
import itertools
import json
import logging
import operator
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal, cast

import pydantic
import torch

from inferscale_engine import cuda_graphs, planner, token_recompute
from inferscale_engine import vllm_compat as compat
from inferscale_engine.config import EngineConfig
from inferscale_engine.connector.exchange import Geometry, KVExchange, NotHeldError
from inferscale_engine.connector.plan import InjectionPlan, injected_tokens
from inferscale_engine.encoder import encode_windows
from inferscale_engine.errors import (
    EngineClosedError,
    EngineSettingsError,
    InferScaleError,
    check_utf8,
)
from inferscale_engine.handles import split_on_handles
from inferscale_engine.kv import FactKV, check_finite
from inferscale_engine.logs import configure_vllm_logging, progress_bars
from inferscale_engine.loop import AsyncEngineLoop, EngineLoop, Loop
from inferscale_engine.request import GenerationOptions
from inferscale_engine.token_recompute import TokenSet
from inferscale_engine.types import (
    DEFAULT_USER,
    AnySource,
    EncodeWindow,
    FactSource,
    GenerationResult,
    MemoryMix,
    Messages,
    Room,
    Segment,
    Span,
    StreamDelta,
    TextFact,
    Usage,
    as_fact_source,
)

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

    from inferscale_engine.memory import MemoryStore

logger = logging.getLogger(__name__)


@dataclass
class _Prepared:
    prompt: dict[str, Any]
    plan: InjectionPlan | None
    staged: list[Span]
    started: float  # perf_counter() when preparation began: TTFT counts the layout and plan too
    memories_as_text: int = 0
    memory_mix: MemoryMix | None = None
    memories_injected: int = 0
    memories_recomputed: int = 0
    # Run once the first token is out: the engine's hand-off of planner.plan's promotions of
    # prefilled cold memories.
    after_first_token: Callable[[], None] | None = None


class InferScaleEngine:
    """One vLLM engine, wired to InferScale's KV connector.

    vLLM runs in this process (one engine per process), or with ``multiprocess=True`` (the
    default with tensor or pipeline parallelism) as it does under ``vllm serve``: its engine core
    and one worker process per rank, which read the facts' KV from shared memory this engine
    stages it in.

    Args:
        model: a local model folder or an alias (``"smollm2"``).
        device: ``"cpu"`` or ``"cuda"``; detected when omitted.
        store_path: folder of the memory store (default under the user's data dir).
        verbose: show vLLM's INFO and WARNING logs (on stdout, vLLM's default). None (default):
            ``$INFERSCALE_VERBOSE``, else errors only, on stderr (:mod:`inferscale_engine.logs`).
        **options: any :class:`EngineConfig` field (``max_model_len``, ``window``, ``dtype``...);
            anything else is passed to vLLM's ``EngineArgs``.
    """

    def __init__(
        self,
        model: str = "smollm2",
        device: Literal["cpu", "cuda"] | None = None,
        store_path: str | os.PathLike | None = None,
        verbose: bool | None = None,
        **options: Any,
    ) -> None:
        from inferscale_engine.models import resolve_model

        configure_vllm_logging(verbose)
        self.config = EngineConfig.from_options(model=model, device=device, store_path=store_path, **options)
        self.model_path = resolve_model(self.config.model)
        self._header_rows: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._token_recompute_checked = False
        if self.config.recompute_tokens is not None:
            self._check_token_recompute()  # before vLLM loads anything
        _configure_vllm_environment(self.config)

        if not self.config.multiprocess and compat.worker_connector_active():
            # vLLM keeps the KV connector process-global: a second live engine would share it.
            raise InferScaleError(
                "another in-process InferScaleEngine is already running in this process; close() it "
                "first, share it, or run with multiprocess=True"
            )
        self._static: OrderedDict[tuple[str | int, ...], Span] = OrderedDict()  # (owner, len(context), *context, *ids)
        self._memory: MemoryStore | None = None
        self._calibration: planner.Calibration | None = None
        self._given_source: AnySource | None = None
        self._fact_source: FactSource | None = None  # the one given, completed (as_fact_source)
        # Promotions of cold memories a request prefilled start here, not in the caller's thread
        # (a generate call, a server's event loop), which then waits for no bookkeeping of theirs.
        self._promotions = ThreadPoolExecutor(1, thread_name_prefix="inferscale-promote")
        self._closed = False
        full_graphs = cuda_graphs.wanted(self.config) and not self.config.vllm_url
        self._start_vllm(cuda_graphs.FULL if full_graphs else {})
        if full_graphs:
            self._check_full_graphs()

    # ------------------------------------------------------------------ lifecycle

    def _check_full_graphs(self) -> None:
        """Keep full CUDA graphs only if they compute this model's prefills as eager steps do."""
        try:
            error = cuda_graphs.prefill_error(self)
        except Exception as exc:
            error, reason = None, f"the check failed: {exc!r}"
        else:
            reason = (
                "no step runs past the largest graph to check against" if error is None else
                f"graphed prefills differ from eager ones by {error:.3g}, tolerance {cuda_graphs.TOLERANCE}"
            )
        if cuda_graphs.keep(error):
            logger.info("full CUDA graphs kept: graphed prefills match eager ones (relative difference %.2g)", error)
            return
        logger.warning("full CUDA graphs not kept (%s); restarting vLLM with its default CUDA graphs", reason)
        self._stop_vllm()
        # The next engine sizes its KV cache from the free device memory: the first one's must be
        # gone, not just unreferenced by vLLM (the loop and rope tables still point into it).
        del self.loop, self.vllm_config
        self.exchange.close()
        gc.collect()
        torch.cuda.empty_cache()
        self._start_vllm({})

    def _start_vllm(self, graph_options: dict[str, Any]) -> None:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.llm_engine import LLMEngine

        cfg = self.config
        _check_vllm_options(cfg.vllm_options, {f.name for f in dataclasses.fields(AsyncEngineArgs)})
        args = AsyncEngineArgs(**{
            # Defaults a caller's vllm_options may override (prefix caching serves plain prompts).
            "enable_prefix_caching": True,
            "disable_log_stats": True,  # periodic stats lines drown a chat UI
            "use_tqdm_on_load": progress_bars(),  # the weight shards' bar, quiet with vLLM's logs
            **graph_options,
            **cfg.vllm_options,
            "model": self.model_path,
            "dtype": compat.engine_dtype(cfg.dtype, cfg.device),
            "max_model_len": cfg.max_model_len,
            "enforce_eager": cfg.enforce_eager,
            "seed": cfg.seed,
            "max_num_seqs": cfg.max_num_seqs,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "kv_transfer_config": KVTransferConfig(
                kv_connector="InferScaleConnector",
                kv_connector_module_path="inferscale_engine.connector",
                kv_role="kv_both",
                kv_connector_extra_config={"fused_rope": cfg.fused_rope,
                                           "recompute_in_forward": cfg.recompute_in_forward},
            ),
        })
        t0 = time.perf_counter()
        self._vllm: Any
        try:
            if cfg.vllm_url:
                self._vllm = self._remote_vllm()
            elif cfg.multiprocess:
                self.loop: Loop = AsyncEngineLoop(lambda: AsyncLLM.from_engine_args(args))
                self._vllm = self.loop.engine
            else:
                self._vllm = LLMEngine.from_engine_args(args)
        except pydantic.ValidationError as exc:
            # vLLM checks its settings in pydantic dataclasses before it loads anything: say which
            # setting, not where deep inside vLLM it was found.
            messages = "; ".join(str(e.get("msg", e)).removeprefix("Value error, ") for e in exc.errors())
            raise EngineSettingsError(f"vLLM refused the engine settings: {messages}") from None
        logger.info("vLLM engine for %s ready in %.1fs", self.model_path, time.perf_counter() - t0)
        self.vllm_config = self._vllm.vllm_config
        model_config = self.vllm_config.model_config
        # None when vLLM runs with skip_tokenizer_init (token-id-only benchmarks).
        self.tokenizer: Any = None if model_config.skip_tokenizer_init else self._vllm.get_tokenizer()
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self.dtype = model_config.dtype
        #: Whether the connector keeps injected prompts out of vLLM's prefix cache
        #: (compat.keep_out_of_prefix_cache); elsewhere they are salted. A server of ours may run
        #: another vLLM release: salted.
        self._can_bypass_prefix_cache = not cfg.vllm_url and compat.can_keep_out_of_prefix_cache()
        self.fingerprint = _fingerprint(self.model_path, self.vllm_config)
        # In-process, vLLM's worker half reads the spans where they lie: nothing to copy.
        self.exchange = KVExchange(Geometry.of_model(model_config), "cuda" if cfg.device == "cuda" else "cpu",
                                   local=not cfg.multiprocess and not cfg.vllm_url, retain_bytes=cfg.staged_kv_bytes())
        if not cfg.multiprocess and not cfg.vllm_url:
            self.loop = EngineLoop(self._vllm)

    def _remote_vllm(self) -> Any:
        """A ``vllm serve`` at ``config.vllm_url`` as this engine's vLLM: what the engine needs of
        the model (tokenizer, KV geometry, fingerprint) from the model's own folder."""
        from vllm.config import ModelConfig, VllmConfig
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        from inferscale_engine.remote import RemoteLoop, server_info

        cfg = self.config
        assert cfg.vllm_url is not None
        info = server_info(cfg.vllm_url)
        model_config = ModelConfig(model=self.model_path, dtype=cfg.dtype,  # type: ignore[arg-type]
                                   max_model_len=cfg.max_model_len or info["max_model_len"] or None)  # type: ignore[arg-type]
        remote = RemoteLoop(cfg.vllm_url, info["id"])
        tokenizer = cached_tokenizer_from_config(model_config)
        self.loop = remote
        return SimpleNamespace(vllm_config=VllmConfig(model_config=model_config), get_tokenizer=lambda: tokenizer,
                               max_model_len=info["max_model_len"] or model_config.max_model_len)

    def _stop_vllm(self) -> None:
        self.loop.close()
        if self.loop.running:
            # A step outlived close()'s wait: tearing vLLM down under it is not safe. Its
            # process-global state then goes whenever vLLM's own finalizer runs
            # (compat.shutdown_engine).
            logger.warning("vLLM engine loop did not stop; leaving vLLM's teardown to garbage collection")
        elif not self.config.multiprocess and not self.config.vllm_url:  # the loops shut theirs down
            compat.shutdown_engine(self._vllm)
        if not self.config.multiprocess and not self.config.vllm_url:
            compat.release_worker_connector()
        self.exchange.close()
        del self._vllm

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed engine serves nothing)."""
        return self._closed

    @property
    def memory_if_built(self) -> MemoryStore | None:
        """The store :attr:`memory` has built (or was given), else ``None``: for a caller that
        must not build one just to look (a metrics scrape loading the embedder)."""
        return self._memory

    def close(self) -> None:
        """Stop the engine loop and free vLLM. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._promotions.shutdown(wait=True)  # before the store they read from closes
        if self._memory is not None:
            self._memory.close()
        self._stop_vllm()

    def __enter__(self) -> InferScaleEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def memory(self) -> MemoryStore:
        """The engine's own memory store (Mem0-style API), and the ``FactSource`` its handles
        resolve through unless ``fact_source`` is set. Built on first use
        (:meth:`MemoryStore.for_engine <inferscale_engine.memory.store.MemoryStore.for_engine>`)
        from this engine's config; assign a store to serve another one. :meth:`close` closes it."""
        if self._memory is None:
            # On first use: an engine that serves another FactSource never loads the store.
            from inferscale_engine.memory import MemoryStore

            self._memory = MemoryStore.for_engine(self)
            self._calibration = planner.Calibration(self, self._memory)
        return self._memory

    @memory.setter
    def memory(self, store: MemoryStore) -> None:
        if self._memory is not None and self._memory is not store:
            self._memory.close()
        self._memory = store
        self._calibration = planner.Calibration(self, store)

    @property
    def fact_source(self) -> AnySource | None:
        """Where handles resolve instead of :attr:`memory` (``None``: the engine's own store).
        A source with less than :class:`~inferscale_engine.types.FactSource` is completed with
        its defaults here, once, not on every request."""
        return self._given_source

    @fact_source.setter
    def fact_source(self, source: AnySource | None) -> None:
        self._fact_source = None if source is None else as_fact_source(source)
        self._given_source = source

    def prefetch(self, user_id: str, *, limit: int = 256) -> int:
        """Start moving ``user_id``'s most recent memories' KV from disk to memory in the
        background, for a session about to start: its first request then injects them instead
        of reading cold files. Returns how many reads started (see ``MemoryStore.prefetch``)."""
        return (self._fact_source or self.memory).prefetch(user_id, limit=limit)

    def calibrate(self, *, refresh: bool = False) -> planner.Rates | None:
        """The cost model's measured rates (prefill times, the store's disk and host-to-device
        speeds), waiting for the start-up measurement; ``refresh`` measures everything again."""
        if refresh or self._calibration is None:
            self._calibration = planner.Calibration(self, self.memory, refresh=refresh)
        return self._calibration.rates()

    def _rates(self) -> planner.Rates | None:
        source = self._fact_source or self._memory
        if source is None or not hasattr(source, "tier_speeds"):
            return None
        if self._calibration is None or self._calibration.store is not source:
            # A source of the caller's own may measure its tiers too (checked just above).
            self._calibration = planner.Calibration(self, cast(planner.MeasuredStore, source))
        return self._calibration.rates()

    def _observed_reads(self) -> planner.ObservedReads | None:
        """The cold-read correction of the store this request reads from (``_rates``' own)."""
        calibration = self._calibration
        if calibration is None or calibration.store is not (self._fact_source or self._memory):
            return None
        return calibration.observed

    # ------------------------------------------------------------------ tokens

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def render(self, prompt_or_messages: str | Messages, *, tools: Sequence[dict[str, Any]] | None = None) -> tuple[str, bool]:
        """Prompt text and whether it came from the chat template.

        ``tools`` (OpenAI-style function schemas) are rendered by the model's own chat template,
        as are assistant messages' ``tool_calls`` (``[{"type": "function", "function": {"name",
        "arguments": {...}}}]``) and ``"tool"`` messages.
        """
        if isinstance(prompt_or_messages, str):
            if tools:
                raise ValueError("tools need chat messages: a prompt string has no chat template to render them")
            return check_utf8(prompt_or_messages, "prompt"), False
        if isinstance(prompt_or_messages, (bytes, bytearray, dict)) or not hasattr(prompt_or_messages, "__iter__"):
            raise TypeError(f"prompt must be a string or a list of chat messages, got {type(prompt_or_messages).__name__}")
        messages = [dict(m) for m in prompt_or_messages]
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each chat message needs string 'role' and 'content'")
            check_utf8(m["content"], "chat message content")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.config.model!r} has no chat template; pass a prompt string")
        extra = {"tools": list(tools)} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return text, True

    # ------------------------------------------------------------------ encoding

    def encode(
        self,
        windows: Sequence[EncodeWindow],
        *,
        progress: bool = False,
        keys: Sequence[Sequence[str | None]] | None = None,
    ) -> list[list[FactKV]]:
        """Encode spans in one batched vLLM pass; see :mod:`inferscale_engine.encoder`.
        ``keys``: per window, per range, the span key the KV will be served under (a
        multiprocess engine keeps it staged for vLLM's workers: its first request copies
        nothing)."""
        self._check_open()
        return encode_windows(self.loop, self.exchange, windows, max_model_len=self.max_model_len,
                              inline=not self.config.multiprocess, progress=progress, keys=keys)

    def encode_fact(self, fact_ids: Sequence[int], context_ids: Sequence[int] = ()) -> FactKV:
        """KV of ``fact_ids`` encoded after ``context_ids`` (context-window encoding)."""
        return self.encode([EncodeWindow.single(fact_ids, context_ids)])[0][0]

    def _static_span(self, token_ids: Sequence[int], context: Sequence[int], user_id: str) -> Span:
        """Head / separator KV, encoded once after ``context`` and kept for ``user_id``.

        Kept per user (unless ``shared_prefix_cache``): a shared cache answers a head another
        user sent before much faster than a new one, which tells a caller whether someone else's
        private text (a system prompt with a PIN) is the one it guessed.
        """
        owner = "" if self.config.shared_prefix_cache else user_id
        cache_key: tuple[str | int, ...] = (owner, len(context), *context, *token_ids)
        span = self._static.get(cache_key)
        if span is None:
            kv = self.encode_fact(token_ids, context)
            check_finite(kv.k, kv.v, "encoded prompt text")
            digest = hashlib.sha256(json.dumps(cache_key).encode()).hexdigest()[:24]
            span = Span(f"static:{digest}", tuple(token_ids), kv)
            self._static[cache_key] = span
            while len(self._static) > self.config.static_cache_entries:
                self._static.popitem(last=False)
        else:
            self._static.move_to_end(cache_key)
        return span

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompt_or_messages: str | Messages, *, user_id: str = DEFAULT_USER,
        tools: Sequence[dict[str, Any]] | None = None, options: GenerationOptions | None = None, **kwargs: Any,
    ) -> GenerationResult:
        """Generate from a prompt string or chat messages; handles in it are injected as KV.

        The options come built as ``options=`` or as keywords, the fields of
        :class:`~inferscale_engine.request.GenerationOptions`: ``max_tokens`` (256),
        ``temperature`` (0.0), ``mode``, ``recompute``, ``first_logprobs``, ``structured``, and
        any other vLLM ``SamplingParams`` field; every option is checked before any work
        (:class:`~inferscale_engine.errors.InvalidOptionError`). ``mode="prompt"`` sends the very
        same token ids without injection (the baseline of pasting facts as text). ``recompute``
        (default: the engine's ``config.recompute``) is the quality knob: the last ``recompute``
        memories of the prompt are prefilled as text after the injected ones, so they attend to
        everything before them; list the most relevant memories last. At least as many as the
        prompt holds gives prompt injection's output. ``tools`` as :meth:`render` takes them.
        """
        options = _options(options, kwargs)
        segments = self.resolve(prompt_or_messages, user_id=user_id, tools=tools, max_tokens=options.max_tokens)
        return self.generate_segments(segments, user_id=user_id, options=options)

    def stream(
        self, prompt_or_messages: str | Messages, *, user_id: str = DEFAULT_USER,
        tools: Sequence[dict[str, Any]] | None = None, options: GenerationOptions | None = None, **kwargs: Any,
    ) -> Iterator[StreamDelta]:
        """Like :meth:`generate`, yielding text as it is produced. The options come as
        :meth:`generate`'s keywords, or built already as ``options=``."""
        options = _options(options, kwargs)
        segments = self.resolve(prompt_or_messages, user_id=user_id, tools=tools, max_tokens=options.max_tokens)
        prepared, params = self._prepare(segments, user_id, options=options)
        yield from self._stream(prepared, params)

    async def agenerate(
        self, prompt_or_messages: str | Messages, *, user_id: str = DEFAULT_USER,
        tools: Sequence[dict[str, Any]] | None = None, options: GenerationOptions | None = None, **kwargs: Any,
    ) -> GenerationResult:
        """Async :meth:`generate` (options as :meth:`stream` takes them)."""
        result = None
        async for delta in self.astream(prompt_or_messages, user_id=user_id, tools=tools,
                                        options=_options(options, kwargs)):
            result = delta.result
        assert result is not None
        return result

    async def astream(
        self, prompt_or_messages: str | Messages, *, user_id: str = DEFAULT_USER,
        tools: Sequence[dict[str, Any]] | None = None, options: GenerationOptions | None = None, **kwargs: Any,
    ) -> AsyncIterator[StreamDelta]:
        """Async :meth:`stream`."""
        import asyncio

        options = _options(options, kwargs)
        # Handle resolution may wait on the store or encode a new head: keep it off the event loop.
        segments = await asyncio.to_thread(self.resolve, prompt_or_messages, user_id=user_id, tools=tools,
                                           max_tokens=options.max_tokens)
        async for delta in self._astream(segments, user_id, options):
            yield delta

    async def astream_segments(
        self, segments: Sequence[Segment], *, user_id: str = DEFAULT_USER, options: GenerationOptions | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[StreamDelta]:
        """Async :meth:`generate_segments`, yielding text as it is produced."""
        async for delta in self._astream(segments, user_id, _options(options, kwargs)):
            yield delta

    async def agenerate_segments(
        self, segments: Sequence[Segment], *, user_id: str = DEFAULT_USER, options: GenerationOptions | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Async :meth:`generate_segments`."""
        result = None
        async for delta in self._astream(segments, user_id, _options(options, kwargs)):
            result = delta.result
        assert result is not None
        return result

    def resolve(
        self, prompt_or_messages: str | Messages, *, user_id: str, tools: Sequence[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
    ) -> list[Segment]:
        """Render, find handles, and turn them into spans: ``[ids, span, ids, span, ..., ids]``.

        A multiprocess engine's spans of memories its exchange holds come without KV (held
        spans, see :class:`~inferscale_engine.types.Span`); :meth:`generate_segments` reads
        their KV only if the exchange gave it up meanwhile. ``max_tokens``: a prompt that cannot
        fit the context with that many tokens after it is refused (:class:`ContextOverflowError`)
        before any memory's KV is read or encoded, where the source checks that (``room=``, see
        :class:`~inferscale_engine.types.FactSource`; the memory store does)."""
        text, is_chat = self.render(prompt_or_messages, tools=tools)
        pieces, handles = split_on_handles(text)
        # The pieces between handles are mostly one separator again and again ("\n", ", "), or
        # empty (handles side by side): one tokenizer call (~25 µs) per distinct piece, not per
        # handle. The same text gives the same ids, so equal pieces share one list.
        between = {p: self.tokenize(p) if p else [] for p in set(pieces[1:])}
        ids = [self.tokenize(pieces[0], add_special_tokens=not is_chat), *map(between.__getitem__, pieces[1:])]
        if handles:
            source: FactSource = self._fact_source or self.memory
            options: dict[str, Any] = {}
            if source.defers_cold:
                options["defer_cold"] = True  # cold ones: _prepare plans them
            if source.skips_held and not self.exchange.local:
                # Spans the exchange holds (staged or retained) are not read again: the
                # owner then does no GPU work for them. In-process, spans go by reference.
                options["held"] = self.exchange.holds
            if max_tokens is not None and source.checks_room:
                # Else a request over the context is refused only after its memories were
                # read, and encoded in this thread where the encode queue had not got to them.
                options["room"] = Room(sum(map(len, ids)), max_tokens, self.max_model_len)
            spans = source.resolve_many(handles, user_id, **options)
            if self._fact_source is not None:
                # A store checks its KV when encoded and when read from disk; a source of the
                # caller's own is checked here: non-finite KV outlives its request in vLLM's cache,
                # and a span of another model's shape would be written out of bounds.
                # A held span has none: it was checked when it was staged.
                for span in spans:
                    if isinstance(span, Span) and span.kv is not None:
                        self.exchange.check(span.kv)
                        check_finite(span.kv.k, span.kv.v, f"KV of {span.key}")
        else:
            spans = []
        segments: list[Segment] = [ids[0]]
        for span, piece_ids in zip(spans, ids[1:]):
            segments.extend([span, piece_ids])
        return segments

    def generate_segments(
        self, segments: Sequence[Segment], *, user_id: str = DEFAULT_USER, options: GenerationOptions | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Generate from already-resolved segments (token id lists and spans); options as
        :meth:`stream` takes them."""
        prepared, params = self._prepare(segments, user_id, options=_options(options, kwargs))
        result = None
        for delta in self._stream(prepared, params):
            result = delta.result
        assert result is not None
        return result

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this InferScaleEngine was closed")

    async def _astream(self, segments: Sequence[Segment], user_id: str, options: GenerationOptions) -> AsyncIterator[StreamDelta]:
        import asyncio

        prepared, params = await asyncio.to_thread(self._prepare, segments, user_id, options=options)
        try:
            state = _Accumulator(prepared)
            async for out, t in self.loop.aiterate(prepared.prompt, params, prepared.started):
                delta = state.update(out, t)
                if delta is not None:
                    yield delta
        finally:
            self._unstage(prepared.staged)

    def _prepare(
        self, segments: Sequence[Segment], user_id: str, options: GenerationOptions | None = None, **kwargs: Any
    ) -> tuple[_Prepared, Any]:
        """The vLLM prompt and sampling parameters of a request, its spans staged. Called with
        ``options=`` by keyword (the tests' probes wrap it, and call it with keywords)."""
        started = time.perf_counter()
        options = _options(options, kwargs)
        try:
            return self._prepare_once(segments, user_id, started, options)
        except NotHeldError:
            # Another request's staging gave up spans this one found held when it was resolved.
            # Read every held span's KV (a fact may have changed since: new tokens, or text) and
            # lay the request out again; without held spans, staging cannot refuse it twice.
            segments = [s.with_kv() if isinstance(s, Span) else s for s in segments]
            return self._prepare_once(segments, user_id, started, options)

    def _prepare_once(
        self, segments: Sequence[Segment], user_id: str, started: float, options: GenerationOptions
    ) -> tuple[_Prepared, Any]:
        from vllm import SamplingParams

        self._check_open()
        # The engine's default, read per request: config.recompute may be changed while serving.
        recompute = self.config.recompute if options.recompute is None else options.recompute
        max_tokens, mode = options.max_tokens, options.mode
        # Checked before the layout, which may encode heads and separators: a prompt that cannot
        # run costs no engine work.
        n = sum(len(s.token_ids) if isinstance(s, Span) else len(s) for s in segments)
        if not n:
            raise ValueError("empty prompt")
        if n + max_tokens > self.max_model_len:
            from_memory = sum(len(s.token_ids) for s in segments if isinstance(s, Span))
            Room(n - from_memory, max_tokens, self.max_model_len).check(from_memory)
        mix = promote = None
        if mode == "inject":
            # Cold memories: wait for their reads or prefill them, whichever the cost model expects
            # to be faster (planner.py); the layout then injects the prefix it leaves as spans.
            segments, mix, promote = planner.plan(segments, recompute, self._rates, self._observed_reads())
        spans, tail, as_text = self._layout(segments, recompute, user_id)
        token_ids = [*itertools.chain.from_iterable(map(_TOKEN_IDS, spans)), *tail]
        extra: dict[str, Any] = {}
        salt = None
        plan = None
        staged = spans if mode == "inject" and spans else []
        if staged:
            keys = [*map(_KEY, spans)]
            repaired, keep = self._recompute_positions(spans, segments)
            kv = self.exchange.stage([*zip(keys, map(_KV, spans))])
            # Recomputed rows bypass the prefix cache: where the cache's layout is not known (the
            # CPU backend) the worker can attend only over rows it injects itself.
            plan = InjectionPlan.tiling(keys, [*map(len, map(_TOKEN_IDS, spans))], kv,
                                        keep_cached=self.config.prefix_cache_injected and repaired is None,
                                        recompute=repaired, recompute_keep=keep)
            # In-process, the plan travels as itself, not as JSON.
            extra["kv_transfer_params"] = plan.to_params(inline=not self.config.multiprocess)
            # Where injected blocks enter vLLM's prefix cache (prefix_cache_injected, or a vLLM
            # without the hooks to keep them out), they do under the prompt's token ids: salt them
            # by user and by exactly which KV they hold, so they never serve a plain or foreign
            # request. The keys in order say that: a key is one span's KV, of one length, so they
            # also fix every span's position. A request that bypasses the cache has no block
            # hashes to salt: the hashing of ~200 keys stays off its path.
            # Recomputed rows hold other KV than the keys': the token set is part of what they hold.
            if plan.keep_cached or not self._can_bypass_prefix_cache:
                what = [user_id, keys] if repaired is None else [user_id, keys, self.config.recompute_tokens]
                salt = "is-" + hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]
        elif not self.config.shared_prefix_cache:
            # Plain prompts are salted by user too: unsalted, a block another user's request left
            # shows up in this one's cached_tokens and time to first token (a prefix-cache oracle).
            salt = "u-" + hashlib.sha256(user_id.encode()).hexdigest()[:32]
        prompt = compat.token_prompt(token_ids, salt)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=options.temperature,
                logprobs=options.first_logprobs,
                extra_args=extra or None,
                # One request's own object: vLLM would otherwise deep-copy it, plan included
                # (~0.4 ms at k=200 on a CPU core, on the request's critical path).
                skip_clone=True,
                **(compat.structured_output(dict(options.structured)) if options.structured else {}),
                **options.sampling,
            )
        except BaseException:
            self._unstage(staged)
            raise
        if mix is not None:
            injected, recomputed = mix.injected + mix.from_disk, mix.recomputed
        else:  # the prompt mode prefills every memory
            injected, recomputed = 0, sum(isinstance(s, (Span, TextFact)) for s in segments)
        after = functools.partial(self._promote_later, promote) if promote is not None else None
        return _Prepared(prompt, plan, staged, started, as_text, mix, after_first_token=after,
                         memories_injected=injected, memories_recomputed=recomputed), params

    def _recompute_positions(
        self, spans: Sequence[Span], segments: Sequence[Segment]
    ) -> tuple[list[int] | None, float | None]:
        """Positions of the injected region whose KV the connector computes again
        (``config.recompute_tokens``, read per request), and the share of them kept past the
        first layer (:attr:`TokenSet.keep`); None: off."""
        spec = self.config.recompute_tokens
        if spec is None:
            return None, None
        self._check_token_recompute()
        token_set = TokenSet.parse(spec)
        memories = {id(s) for s in segments if isinstance(s, Span)}  # heads and separators are the engine's
        return token_recompute.positions([(s.token_ids, id(s) in memories) for s in spans],
                                         functools.partial(self._memory_rows, token_set),
                                         token_set.last_memories), token_set.keep

    def _memory_rows(self, token_set: TokenSet, token_ids: Sequence[int]) -> int:
        """How many of a memory's first tokens ``token_set`` recomputes; headers kept per memory
        opening (the rule detokenizes, and a memory is served many times)."""
        if token_set.kind != "header":
            return token_set.rows(token_ids, self.detokenize)
        key = tuple(token_ids[: token_recompute.HEADER_TOKENS])
        rows = self._header_rows.get(key)
        if rows is None:
            rows = self._header_rows[key] = token_set.rows(token_ids, self.detokenize)
            while len(self._header_rows) > _HEADER_ROWS_KEPT:
                self._header_rows.popitem(last=False)
        return rows

    def _check_token_recompute(self) -> None:
        """Refuse ``recompute_tokens`` where the connector's layer-wise forward cannot run, before
        any request reaches it (a refusal inside vLLM's step would stop its engine core)."""
        if self._token_recompute_checked:
            return
        if self.config.vllm_url:
            raise EngineSettingsError("recompute_tokens runs inside this engine's own vLLM workers; a vllm_url "
                                      "server's connector does not run it")
        parallel = self.config.vllm_options.get("pipeline_parallel_size") or 1
        if int(parallel) > 1:
            raise EngineSettingsError("recompute_tokens does not run with pipeline parallelism")
        from transformers import AutoConfig

        try:
            architectures = getattr(AutoConfig.from_pretrained(self.model_path), "architectures", None) or []
        except (OSError, ValueError) as exc:  # a GGUF file, a folder without config.json
            raise EngineSettingsError(f"recompute_tokens needs the model's architecture, and {self.model_path} "
                                      f"has no readable config.json ({exc})") from None
        if not set(architectures) & set(compat.RECOMPUTE_ARCHITECTURES):
            raise EngineSettingsError(
                f"recompute_tokens supports {', '.join(compat.RECOMPUTE_ARCHITECTURES)}; {self.model_path} is "
                f"{', '.join(architectures) or 'of no declared architecture'}")
        self._token_recompute_checked = True

    def _promote_later(self, promote: Callable[[], None]) -> None:
        try:
            self._promotions.submit(_logged, promote, "promoting prefilled cold memories")
        except RuntimeError:  # the engine is closing: they stay on disk for the next start
            pass

    def _layout(self, segments: Sequence[Segment], recompute: int = 0,
                user_id: str = DEFAULT_USER) -> tuple[list[Span], list[int], int]:
        """Spans covering everything up to the last injected fact, the computed tail after it, and
        how many memories come as text (:class:`TextFact`).

        The last ``recompute`` facts belong to the tail: vLLM prefills them, with the separators
        and text around them, after the injected prefix (the connector loads only a prefix).
        """
        # One pass over the segments (hundreds on an injected request's path).
        facts: list[int] = []
        as_text: list[int] = []
        for i, s in enumerate(segments):
            if isinstance(s, Span):
                facts.append(i)
            elif isinstance(s, TextFact):
                facts.append(i)
                as_text.append(i)
        last = facts[len(facts) - recompute - 1] if recompute < len(facts) else -1
        if as_text and as_text[0] <= last:  # injected KV is a prefix: stop before it
            last = max((i for i in facts if i < as_text[0]), default=-1)
        head: Sequence[int] = ()
        spans: list[Span] = []
        for i, seg in enumerate(segments[: last + 1]):
            if isinstance(seg, Span):
                spans.append(seg)
            elif len(seg):
                spans.append(self._static_span(seg, context=head if spans else (), user_id=user_id))
                if i == 0:
                    head = seg
        tail = [int(t) for seg in segments[last + 1 :] for t in (seg.token_ids if isinstance(seg, Span) else seg)]
        return spans, tail, len(as_text)

    def _unstage(self, spans: list[Span]) -> None:
        if spans and not self.exchange.local:  # a local exchange staged nothing: the plan held them
            self.exchange.unstage([s.key for s in spans])

    def _stream(self, prepared: _Prepared, params: Any) -> Iterator[StreamDelta]:
        try:
            state = _Accumulator(prepared)
            for out, t in self.loop.iterate(prepared.prompt, params, prepared.started):
                delta = state.update(out, t)
                if delta is not None:
                    yield delta
        finally:
            self._unstage(prepared.staged)


class _Accumulator:
    """Turns vLLM's cumulative outputs into text deltas and a final :class:`GenerationResult`."""

    def __init__(self, prepared: _Prepared) -> None:
        self.prepared = prepared
        self.sent = 0
        self.ttft: float | None = None

    def update(self, out: RequestOutput, t: float) -> StreamDelta | None:
        completion = out.outputs[0]
        if self.ttft is None and completion.token_ids:
            self.ttft = t
            if self.prepared.after_first_token is not None:
                self.prepared.after_first_token()
        text = completion.text[self.sent :]
        self.sent = len(completion.text)
        if not out.finished:
            return StreamDelta(text) if text else None
        prompt_ids = list(self.prepared.prompt["prompt_token_ids"])
        first = None
        if completion.logprobs:
            first = {tok: lp.logprob for tok, lp in completion.logprobs[0].items()}
        result = GenerationResult(
            text=completion.text,
            token_ids=list(completion.token_ids),
            finish_reason=completion.finish_reason,
            usage=Usage(
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(completion.token_ids),
                injected_tokens=injected_tokens(out.kv_transfer_params),
                cached_tokens=int(out.num_cached_tokens or 0),
                memories_injected=self.prepared.memories_injected,
                memories_recomputed=self.prepared.memories_recomputed,
                memories_as_text=self.prepared.memories_as_text,
                memory_mix=self.prepared.memory_mix,
            ),
            ttft_s=self.ttft if self.ttft is not None else t,
            latency_s=t,
            prompt_token_ids=prompt_ids,
            first_logprobs=first,
        )
        return StreamDelta(text, result)


#: Memory openings whose header length an engine keeps (``recompute_tokens="header"``).
_HEADER_ROWS_KEPT = 65536

#: A request's spans' fields, read by ``map`` (no Python frame per span).
_KEY, _KV, _TOKEN_IDS = operator.attrgetter("key"), operator.attrgetter("kv"), operator.attrgetter("token_ids")


def _logged(fn: Callable[[], None], what: str) -> None:
    try:
        fn()
    except Exception:  # a background task's failure must be seen, not lost in its future
        logger.exception("%s failed", what)


def _options(options: GenerationOptions | None, kwargs: dict[str, Any]) -> GenerationOptions:
    """A request's options: given built, or built (and so checked) once from its keywords."""
    if options is None:
        return GenerationOptions.from_kwargs(**kwargs)
    if kwargs:
        raise TypeError(f"generation options come as options= or as keywords, not both (got options= and "
                        f"{', '.join(sorted(kwargs))})")
    return options


def _check_vllm_options(options: dict[str, Any], known: set[str]) -> None:
    """Refuse, before vLLM starts, options it would not take (a ``TypeError`` deep inside it)
    and the one that is InferScale's."""
    if "kv_transfer_config" in options:
        raise EngineSettingsError("kv_transfer_config is InferScale's own: its KV connector is how facts are injected")
    unknown = sorted(set(options) - known)
    if unknown:
        names = known | set(EngineConfig.__dataclass_fields__)
        hints = [f"{name} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(name, names, n=1)) else name
                 for name in unknown]
        raise EngineSettingsError(
            f"unknown engine option{'s' if len(unknown) > 1 else ''}: {', '.join(hints)}; "
            "options are InferScale's EngineConfig fields or vLLM's EngineArgs"
        )


def _configure_vllm_environment(cfg: EngineConfig) -> None:
    """Settings vLLM reads from the environment; must be in place before its engine starts."""
    # Read by vLLM when an engine starts (the multiprocess one is AsyncLLM's own).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.multiprocess else "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if cfg.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.cpu_kv_cache_gib))))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _fingerprint(model_path: str, vllm_config: Any) -> str:
    """Identity of whatever changes KV bytes: weights' config, dtype, rope settings."""
    mc = vllm_config.model_config
    config_file = Path(model_path) / "config.json"
    config_hash = hashlib.sha256(config_file.read_bytes()).hexdigest() if config_file.exists() else model_path
    weights = sorted(p.name + str(p.stat().st_size) for p in Path(model_path).glob("*.safetensors"))
    # The rope settings vLLM actually uses: engine options (hf_overrides) can change them
    # without touching config.json.
    hf = getattr(mc, "hf_config", None)
    rope = {k: getattr(hf, k, None) for k in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")}
    src = json.dumps([config_hash, weights, str(mc.dtype), str(vllm_config.cache_config.cache_dtype), rope],
                     sort_keys=True, default=str)
    return hashlib.sha256(src.encode()).hexdigest()[:16]
