"""What the orchestrator's parts share (:class:`RelayContext`) and their common base
(:class:`RelayPart`)."""

from __future__ import annotations

from dataclasses import dataclass

from topkv.policy.clock import Clock
from topkv.relay.completions import CompletionQueue
from topkv.relay.executor import TransferExecutor
from topkv.relay.liveview import LiveWorkerView
from topkv.relay.metrics import RelayMetrics
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.slots import DecodeSlots
from topkv.relay.transfers import TransferTable


@dataclass(frozen=True)
class RelayContext:
    """One orchestrator's executor, limits, worker view, transfer table, decode slots,
    completion queue, metrics and clock."""

    executor: TransferExecutor
    config: OrchestratorConfig
    view: LiveWorkerView
    transfers: TransferTable
    slots: DecodeSlots
    completions: CompletionQueue
    metrics: RelayMetrics
    clock: Clock


class RelayPart:
    """A part of the orchestrator (routing, the attempt loop, handoff) over its context."""

    def __init__(self, context: RelayContext) -> None:
        self.executor = context.executor
        self.config = context.config
        self.view = context.view
        self.transfers = context.transfers
        self.slots = context.slots
        self.completions = context.completions
        self.metrics = context.metrics
        self.clock = context.clock
