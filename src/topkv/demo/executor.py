"""The relay orchestrator's :class:`~topkv.relay.executor.TransferExecutor` over the demo's
worker processes.

The orchestrator decides (decode worker, transport, retry, failover, reroute); this
executor carries each attempt out with the demo's workers:

* ``transfer(plan)``: the decode worker is told to expect the copy (:class:`Expect`
  ``decode``), then the prefill worker to *stream* it (:class:`Send` ``stream``): every
  layer already computed goes out at once and each later one as its forward-pass hook
  fires, over the medium under the chosen path (shm for same-node classes, tcp otherwise),
  paced to that path (:mod:`topkv.transport.emulated`). The attempt ends when the prefill worker
  saw the destination's acknowledgement (:class:`SendDone`) *and* the decode worker
  reported the verified copy it now holds with its digest (:class:`Held`). A retry sends
  again from the layers the prefill worker holds.
* ``source_digest``: the prefill worker reports its digest with :class:`PrefillDone`, at
  the end of the forward pass; the orchestrator asks for it at verification
  (``submit(..., defer_digest=True)``), so no attempt waits for prefill to end.
* ``release_source`` releases the relay's hold on the prefill worker's KV (the demo's
  baselines hold it separately); ``discard_destination`` drops the decode worker's copy;
  ``probe`` asks whether the worker process is alive.

Events from the workers reach :meth:`DemoExecutor.on_event` on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from topkv.demo.protocol import (
    CancelSend,
    Discard,
    Event,
    Expect,
    Failed,
    Held,
    LinkSpec,
    PrefillDone,
    Release,
    Send,
    SendDone,
)
from topkv.demo.topology import LinkChoice
from topkv.relay.executor import AttemptFailed, AttemptPlan, Delivery
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import KVLayout

STREAM = "stream"

#: The link a transfer between two workers takes over a named path class.
LinkLookup = Callable[[str, str, str, int, int], LinkChoice]


class WorkerPort:
    """What the executor needs of the cluster: send a message, is a process alive."""

    def __init__(self, send: Callable[[str, object], None], alive: Callable[[str], bool]) -> None:
        self.send = send
        self.alive = alive


@dataclass(frozen=True)
class StreamAttempt:
    """One delivered streaming attempt: the figures the demo measures come from it."""

    wire_rid: int
    transport: str
    link: LinkChoice
    send: SendDone
    held: Held


def _failure(kind: str | None) -> FailureKind:
    try:
        return FailureKind(kind) if kind else FailureKind.TRANSPORT
    except ValueError:
        return FailureKind.INTERNAL


class DemoExecutor:
    """Runs the orchestrator's attempts on the demo's worker processes (see module doc)."""

    def __init__(
        self,
        port: WorkerPort,
        addresses: Mapping[str, Mapping[str, str]],
        link_for: LinkLookup,
        *,
        dilation: float,
        new_tokens: int,
        timeout_s: float,
    ) -> None:
        self.port = port
        self.addresses = addresses
        self.link_for = link_for
        self.dilation = dilation
        self.new_tokens = new_tokens
        self.timeout_s = timeout_s
        self._wires = itertools.count(1)
        self._digests: dict[int, asyncio.Future[int]] = {}
        self._sends: dict[int, asyncio.Future[SendDone]] = {}
        self._helds: dict[int, asyncio.Future[Held]] = {}
        #: The latest delivered attempt of each request.
        self.delivered: dict[int, StreamAttempt] = {}
        self.attempts = 0

    def new_wire(self) -> int:
        """A transfer id no other attempt or baseline copy uses."""
        return next(self._wires)

    # -- events ----------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        """Resolve the attempt or digest an event answers (call on the loop's thread)."""
        if isinstance(event, PrefillDone):
            digest = self._digest(event.rid)
            if not digest.done():
                digest.set_result(event.digest)
        elif isinstance(event, Failed) and event.rid >= 0:
            future = self._digests.get(event.rid)
            if future is not None and not future.done():
                future.set_exception(
                    AttemptFailed(FailureKind.SOURCE_LOST, f"{event.worker_id}: {event.message}")
                )
        elif isinstance(event, SendDone) and event.tag == STREAM:
            send = self._sends.get(event.wire_rid)
            if send is not None and not send.done():
                send.set_result(event)
        elif isinstance(event, Held):
            held = self._helds.get(event.wire_rid)
            if held is not None and not held.done():
                held.set_result(event)

    def forget(self, request_id: int) -> None:
        """Drop what is kept about a finished request."""
        future = self._digests.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def _digest(self, request_id: int) -> asyncio.Future[int]:
        future = self._digests.get(request_id)
        if future is None:
            future = self._digests[request_id] = asyncio.get_running_loop().create_future()
        return future

    # -- TransferExecutor ------------------------------------------------------------------

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        return await asyncio.shield(self._digest(request_id))

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        source, destination = plan.source.worker_id, plan.destination.worker_id
        nbytes, layers = plan.layout.total_bytes, plan.layout.num_layers
        try:
            link = self.link_for(source, destination, plan.transport, nbytes, layers)
        except Exception as exc:
            raise AttemptFailed(FailureKind.TRANSPORT, str(exc)) from exc
        address = self.addresses.get(destination, {}).get(link.medium)
        if address is None:
            raise AttemptFailed(FailureKind.TRANSPORT, f"{destination} has no {link.medium} sink")
        wire = self.new_wire()
        loop = asyncio.get_running_loop()
        send_done: asyncio.Future[SendDone] = loop.create_future()
        held_done: asyncio.Future[Held] = loop.create_future()
        self._sends[wire], self._helds[wire] = send_done, held_done
        self.attempts += 1
        rid = plan.request_id
        self.port.send(
            destination,
            Expect(
                rid=rid,
                tag=STREAM,
                wire_rid=wire,
                medium=link.medium,
                kind="decode",
                prompt_len=plan.layout.seq_len,
                max_new_tokens=self.new_tokens,
                timeout_s=plan.timeout_s,
            ),
        )
        self.port.send(
            source,
            Send(
                rid=rid,
                tag=STREAM,
                wire_rid=wire,
                medium=link.medium,
                destination=address,
                link=LinkSpec(link.mode, link.bandwidth_gbps, link.setup_s, self.dilation),
                schedule="stream",
                first_token_to=destination,
                timeout_s=plan.timeout_s,
            ),
        )
        try:
            sent = await send_done
            if sent.error is not None:
                raise AttemptFailed(_failure(sent.failure), f"{source} send: {sent.error}")
            held = await held_done
            if held.error is not None:
                raise AttemptFailed(_failure(held.failure), f"{destination}: {held.error}")
        except BaseException:
            # Cancelled or failed: stop the sender and leave nothing at the destination.
            self.port.send(source, CancelSend(rid, wire))
            self.port.send(destination, Discard(rid, wire))
            raise
        finally:
            self._sends.pop(wire, None)
            self._helds.pop(wire, None)
        self.delivered[rid] = StreamAttempt(wire, plan.transport, link, sent, held)
        return Delivery(
            request_id=rid,
            destination=destination,
            transport=plan.transport,
            medium=f"{link.medium} (emulated {link.mode})",
            size_bytes=nbytes,
            seconds=held.verified_s - sent.start_s,
            digest=held.digest,
            emulated=True,
        )

    async def probe(self, worker: WorkerInfo) -> bool:
        return self.port.alive(worker.worker_id)

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        self.port.send(source.worker_id, Release(request_id, "relay"))

    async def discard_destination(self, destination: WorkerInfo, request_id: int) -> None:
        self.port.send(destination.worker_id, Discard(request_id))
        self.delivered.pop(request_id, None)
