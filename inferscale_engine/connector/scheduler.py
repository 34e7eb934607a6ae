"""The connector's scheduler half: lives in vLLM's engine core (its scheduler's connector, built
with role SCHEDULER), claims injected prompt tokens and tells the workers what to do each step.

A request whose ``kv_transfer_params`` hold an :class:`InjectionPlan` claims its prompt tokens
``[local prefix-cache hit, plan.end)`` as external hits (leaving at least one token for vLLM to
compute); once vLLM has allocated their blocks the half queues the slots to fill for the
worker. A :class:`CapturePlan` request is an ordinary prefill: each step the half turns its
capture ranges into the cache slots vLLM computes them into. Both reach the workers in
:class:`InferScaleConnectorMetadata`, built once per step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from inferscale_engine import vllm_compat as compat
from inferscale_engine.connector.exchange import Geometry, Location
from inferscale_engine.connector.plan import (
    BYPASSED_KEY,
    INJECTED_KEY,
    CapturePlan,
    CaptureSlots,
    InferScaleConnectorMetadata,
    InjectionPlan,
    LoadRequest,
    bypasses_prefix_cache,
    parse_params,
)
from inferscale_engine.errors import ConnectorError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class ConnectorScheduler:
    """The scheduler half of :class:`~inferscale_engine.connector.connector.InferScaleConnector`:
    its scheduler-side methods, with vLLM's signatures."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._plans: dict[str, InjectionPlan | CapturePlan] = {}
        self._claimed: dict[str, tuple[int, int]] = {}  # req_id -> (first token, count)
        self._injected: dict[str, int] = {}  # req_id -> prompt tokens injected at its last admission
        self._loads: list[LoadRequest] = []
        self._capture_blocks: dict[str, list[int]] = {}
        self._load_at: dict[str, Location] = {}  # where this step's loads read
        self._geometry: Geometry | None = None
        self._descriptors: dict[str, dict[str, Any]] = {}  # every segment plans described
        self._described: set[str] = set()  # segments the workers were told of
        self._prefix_cache_hooked = False
        #: Whether requests that ask to bypass vLLM's prefix cache get no hits from it (hooked,
        #: or prefix caching off), so a streamed reply's cached_tokens count only injected ones.
        self._bypassing = False

    def _slots(self, block_ids: list[int], start: int, stop: int) -> list[int]:
        bs = self._block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, stop) if p // bs < len(block_ids)]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._prefix_cache_hooked:
            # Once, from the engine core's first step (it hands the connector no reference).
            self._prefix_cache_hooked = True
            core = compat.calling_engine_core()
            if core is not None:
                self._bypassing = compat.keep_out_of_prefix_cache(
                    core, lambda r: bypasses_prefix_cache(r.kv_transfer_params))
        try:
            plan = parse_params(request.kv_transfer_params)
        except ValueError as exc:  # the engine validates first; never kill the scheduler
            logger.error("request %s: ignoring bad inferscale params: %s", request.request_id, exc)
            plan = None
        if plan is None:
            return 0, False
        self._plans[request.request_id] = plan
        self._descriptors.update(plan.kv.segments)
        if not isinstance(plan, InjectionPlan):
            return 0, False
        # vLLM must compute at least one prompt token to produce logits.
        end = min(plan.end, request.num_prompt_tokens - 1)
        count = max(0, end - num_computed_tokens)
        self._claimed[request.request_id] = (num_computed_tokens, count)
        return count, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        start, count = self._claimed.pop(request.request_id, (0, 0))
        if num_external_tokens == 0:
            return
        if num_external_tokens != count:
            raise ConnectorError(f"vLLM allocated {num_external_tokens} external tokens, connector claimed {count}")
        plan = self._plans[request.request_id]
        assert isinstance(plan, InjectionPlan)
        stop = start + count
        pieces = plan.pieces(start, stop)
        block_ids = compat.single_group_block_ids(blocks.get_block_ids())
        load = LoadRequest(block_ids, start, stop, pieces, plan.kv.ready)
        if plan.recompute is not None:
            # Positions vLLM's prefix cache held (below start) were recomputed by the request
            # that left them; positions vLLM computes itself (from stop) need nothing.
            rows = plan.recompute[(plan.recompute >= start) & (plan.recompute < stop)]
            if len(rows):
                load.recompute = rows
                ids = request.prompt_token_ids
                assert ids is not None  # an injection plan comes with token ids, never embeddings
                load.recompute_ids = np.array([ids[p] for p in rows.tolist()], dtype=np.int64)
                load.recompute_keep = plan.recompute_keep
        self._loads.append(load)
        if pieces.kvs is None:  # in shared memory, not carried by the plan: where each span lies
            at = plan.kv.at
            self._load_at.update({key: at[key] for key in pieces.keys})
        self._geometry = plan.kv.geometry
        self._injected[request.request_id] = count

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> InferScaleConnectorMetadata:
        meta = InferScaleConnectorMetadata(loads=self._loads, at=self._load_at, geometry=self._geometry)
        self._loads, self._load_at = [], {}

        scheduled = []  # (capture request, prompt tokens computed before this step)
        for new in scheduler_output.scheduled_new_reqs:
            if isinstance(self._plans.get(new.req_id), CapturePlan):
                self._capture_blocks[new.req_id] = compat.single_group_block_ids(new.block_ids)
                scheduled.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._capture_blocks:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                ids = compat.single_group_block_ids(new_ids)
                if compat.is_resumed(cached, i):
                    self._capture_blocks[req_id] = ids
                else:
                    self._capture_blocks[req_id].extend(ids)
            scheduled.append((req_id, cached.num_computed_tokens[i]))

        for req_id, done in scheduled:
            plan = self._plans[req_id]
            assert isinstance(plan, CapturePlan)  # only captures have blocks kept
            blocks = self._capture_blocks[req_id]
            end = done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            for r in plan.ranges:
                lo, hi = max(r.start, done), min(r.start + r.length, end)
                if lo < hi:
                    meta.captures.append(CaptureSlots(r.capture_id, r.length, lo - r.start, self._slots(blocks, lo, hi)))
                    meta.at[r.capture_id] = plan.kv.at[r.capture_id]
                    meta.geometry = plan.kv.geometry
        needed = {loc.segment for loc in meta.at.values()} | {load.ready[0] for load in meta.loads if load.ready}
        undescribed = needed - self._described
        if undescribed:
            meta.segments = {name: self._descriptors[name] for name in undescribed}
            self._described |= undescribed
        if meta.captures:
            compat.start_load_before_forward(scheduler_output)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        plan = self._plans.pop(request.request_id, None)
        self._claimed.pop(request.request_id, None)
        self._capture_blocks.pop(request.request_id, None)
        injected = self._injected.pop(request.request_id, None)
        if plan is None:
            return False, None
        # vLLM hands these to the request's final (non-streamed) output: the engine's usage
        # reports what was injected, not what the plan covered (vLLM's prefix cache may have held
        # part of it); a front end of a vLLM server learns whether a streamed reply's
        # cached_tokens are injected tokens only (inferscale_engine.remote).
        return False, {INJECTED_KEY: injected or 0,
                       BYPASSED_KEY: self._bypassing and bypasses_prefix_cache(request.kv_transfer_params)}
