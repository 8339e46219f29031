"""How a worker sends one held KV cache: when each layer leaves, and over which link.

``POST /v1/send`` names a *schedule* (:class:`~topkv.service.messages.SendRequest`):

* ``stream``: every layer published so far at once, then each new one the moment the
  engine's prefill publishes it (from the engine's thread): the pipelined transfer. A KV
  that is already whole goes out at once.
* ``serial``: wait until the KV is whole, then send every layer (the whole cache at once).
* ``replay``: wait until whole, then send layer ``l`` at ``start + (ready_l -
  forward_start)``: prefill's recorded compute schedule replayed over another path, which
  measures what that path would have exposed had the pipelined transfer taken it.

A send may be *paced* to an emulated path (:func:`paced_source`, the one builder of a
worker's emulated sources: a send's emulated path, or the slowed link of fault injection):
the bytes still move over the worker's real medium, each layer leaving no earlier than the
modelled link lets it.
:class:`SendStamps` records when each layer was offered to the (paced) transport and when it
left the paced link for the real medium.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from topkv.service.kvstore import HeldKV
from topkv.transport.base import OutgoingTransfer, TransferSource, TransportMode
from topkv.transport.emulated import EmulatedSource, LinkModel
from topkv.transport.errors import TransferTimeout

now = time.perf_counter


def paced_source(
    medium: TransferSource,
    mode: str,
    bandwidth_gbps: float,
    setup_s: float,
    *,
    dilation: float = 1.0,
) -> EmulatedSource:
    """``medium`` paced to one modelled ``mode`` link (``bandwidth_gbps`` decimal GB/s,
    ``setup_s`` per chunk), ``dilation`` times slower than modelled.

    A send's emulated path (:class:`~topkv.service.messages.PacedLink`) gets one per send,
    dropped after it, never closed (the medium is the worker's); a slowed worker's sources
    (fault injection) keep theirs.
    """
    link = LinkModel(TransportMode(mode), bandwidth_gbps, setup_s)
    return EmulatedSource(medium, link, dilation=dilation)


@dataclass
class SendStamps:
    """When each layer of one send was offered to its transport (``perf_counter``)."""

    offered_s: dict[int, float] = field(default_factory=dict)

    def offered(self, layers: int) -> list[float]:
        return [self.offered_s[i] for i in range(layers)]

    @staticmethod
    def handed(out: OutgoingTransfer, offered: list[float]) -> list[float]:
        """When each layer left a paced link for the real medium (unpaced: when offered)."""
        handed: dict[int, float] | None = getattr(out, "handed_to_medium", None)
        if handed is None:
            return offered
        return [handed[i] for i in range(len(offered))]


async def wait_ended(kv: HeldKV, timeout_s: float | None) -> None:
    """Wait (on the loop) until ``kv`` is whole or failed; TransferTimeout after ``timeout_s``."""
    if kv.ended:
        return
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        loop.call_soon_threadsafe(_resolve, ended)

    kv.when_ended(wake)
    try:
        await asyncio.wait_for(ended, timeout_s)
    except TimeoutError:
        raise TransferTimeout(
            f"request {kv.request_id}: prefill did not finish within {timeout_s} s"
        ) from None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def send_scheduled(
    out: OutgoingTransfer,
    kv: HeldKV,
    schedule: str,
    timeout_s: float,
    stamps: SendStamps,
    *,
    off_loop: bool,
) -> None:
    """Hand every layer of ``kv`` to ``out`` as ``schedule`` says; returns once the last one
    was handed over (the acknowledgement is ``out.finish()``'s). ``off_loop``: hand a whole
    KV over from a thread (a transport whose ``send_layer`` may wait, e.g. a fault link)."""
    if schedule == "stream" and not kv.complete:
        await _stream_layers(out, kv, timeout_s, stamps)
        return
    if schedule != "stream":
        await wait_ended(kv, timeout_s)
        kv.check_whole()
    if schedule == "replay":
        start = now()
        forward_start = kv.forward_start_s if kv.forward_start_s is not None else kv.ready_s[0]
        due = [start + (ready - forward_start) for ready in kv.ready_s]
        await asyncio.to_thread(_send_layers, out, kv, stamps, due)
        return
    if off_loop:
        await asyncio.to_thread(_send_layers, out, kv, stamps, None)
    else:
        _send_layers(out, kv, stamps, None)


async def _stream_layers(
    out: OutgoingTransfer, kv: HeldKV, timeout_s: float, stamps: SendStamps
) -> None:
    """Send the layers published so far, then each new one the moment prefill publishes it
    (from the engine's thread); returns once the last one was queued."""
    errors: list[BaseException] = []

    def offer(index: int, tensors: tuple[memoryview, ...], crcs: tuple[int, ...]) -> None:
        if errors:
            return
        stamps.offered_s[index] = now()
        try:
            out.send_layer(index, tensors, crcs)
        except Exception as exc:  # raised below, on the loop
            errors.append(exc)

    unsubscribe = kv.subscribe(offer)
    try:
        await wait_ended(kv, timeout_s)
    finally:
        unsubscribe()
    if errors:
        raise errors[0]
    kv.check_whole()


def _send_layers(
    out: OutgoingTransfer, kv: HeldKV, stamps: SendStamps, due: list[float] | None
) -> None:
    """Every layer in order; with ``due``, layer ``l`` no earlier than ``due[l]``."""
    for layer, (tensors, crcs) in enumerate(zip(kv.layers, kv.crcs, strict=True)):
        if due is not None and (delay := due[layer] - now()) > 0:
            time.sleep(delay)
        stamps.offered_s[layer] = now()
        out.send_layer(layer, tensors, crcs)
