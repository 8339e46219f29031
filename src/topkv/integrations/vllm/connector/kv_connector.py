"""``TopKVConnector``: vLLM's ``KVConnectorBase_V1`` over TopKV's wire format and transports.

Load it in vLLM with::

    --kv-transfer-config '{"kv_connector": "TopKVConnector",
        "kv_connector_module_path": "topkv.integrations.vllm",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"secret_file": "...", "registry_url": "...", ...}}'

The class only adapts vLLM's calls: the scheduler half is
:class:`~.scheduler_side.SchedulerSide`, the worker half :class:`~.worker_side.WorkerSide`
(see their docstrings for the protocol); ``docs/vllm.md`` lists every setting. Written
against vLLM 0.32.0 (its connector API is experimental: the extra pins the version).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform

from topkv.errors import TopKVError
from topkv.integrations.vllm.connector.params import ConnectorSettings, shm_socket_path
from topkv.integrations.vllm.connector.registration import BackgroundRegistration
from topkv.integrations.vllm.connector.scheduler_side import SchedulerSide, StepPlan
from topkv.integrations.vllm.connector.worker_side import WorkerSide, default_layout
from topkv.relay.workers import WorkerCapabilities, WorkerInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class TopKVMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    plan: StepPlan = field(default_factory=StepPlan)


def _bytes_per_token(kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """(block size, bytes of one token's K and V over every layer) of the first group."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    return spec.block_size, spec.page_size_bytes // spec.block_size * len(group.layer_names)


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers: show topkv's INFO lines in its log too."""
    logger = logging.getLogger("topkv")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class TopKVConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped here
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_to_stderr()
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(
            transfer.kv_connector_extra_config or {}, transfer.kv_role
        )
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._registration: BackgroundRegistration | None = None
        if role == KVConnectorRole.SCHEDULER:
            block_size, per_token = _bytes_per_token(kv_cache_config)
            self.scheduler = SchedulerSide(self.settings, block_size, per_token)
        else:
            model_id = str(vllm_config.model_config.served_model_name or "model")
            self.worker = WorkerSide(
                self.settings, model_id, default_layout(current_platform.is_cpu())
            )

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        first = next(iter(kv_caches.values()))
        if (
            current_platform.is_cpu()
            and first.dtype == torch.bfloat16
            and torch.cpu._is_amx_tile_supported()
        ):
            raise TopKVError(
                "TopKVConnector: vLLM's AMX kernel (bfloat16 on a CPU with AMX) packs KV pages "
                "in a layout TopKV does not read yet; run with --dtype float32 or float16"
            )
        self.worker.register(kv_caches)
        s = self.settings
        if s.registry_url:
            media = self.worker.offer.media
            sinks = self.worker.sinks
            others = tuple(sink.address for m, sink in sinks.items() if m not in ("tcp", "shm"))
            tcp = sinks.get("tcp")
            info = WorkerInfo(
                worker_id=s.worker_id,
                role=s.role,
                node=s.host_id,
                host_id=s.host_id,
                capabilities=WorkerCapabilities(
                    tcp="tcp" in media, shm="shm" in media, media=media
                ),
                # the tcp sink (else the first other one: the front door needs an address)
                address=tcp.address if tcp is not None else (others[0] if others else ""),
                control_url=s.api_url,
                sink_addresses=others,
            )
            self._registration = BackgroundRegistration(s.registry_url, s.token, info)

    def _plan(self) -> StepPlan:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, TopKVMetadata) else StepPlan()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_loads(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its KV is in place

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self.worker is not None
        plan = self._plan()
        if plan.saves:
            self.worker.save_layer(plan, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.end_saves(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        sending, recving = self.worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            registration = self._registration
            self.worker.close(registration.close if registration is not None else None)
            if self.settings.role == "decode":
                self._unlink_shm()

    def _unlink_shm(self) -> None:
        import contextlib
        import os

        with contextlib.suppress(OSError):
            os.unlink(shm_socket_path(self.settings.shm_dir, self.settings.worker_id))

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        manager = self._kv_cache_manager

        def blocks(req_id: str) -> list[int]:
            return list(manager.get_block_ids(req_id)[0]) if manager is not None else []

        plan = self.scheduler.plan(
            scheduler_output.scheduled_new_reqs,
            scheduler_output.scheduled_cached_reqs,
            scheduler_output.num_scheduled_tokens,
            blocks,
        )
        return TopKVMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.loaded(
            set(connector_output.finished_recving or ()),
            set(connector_output.invalid_block_ids or ()),
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request)
