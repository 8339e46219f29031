"""The connector's worker half: streams layers out during prefill, loads them on decode.

Prefill: ``save_kv_layer`` is called by every attention layer right after it wrote this
step's KV into the paged cache; each :class:`~.scheduler_side.SaveSpec` of the step gets
that layer gathered into the wire layout (:mod:`.layout`) and queued on a TopKV transport
(the medium the front door picked for the pair: shm to a sink on this host, tcp, or nixl or
mooncake where installed; :mod:`.media`) at once, so the copy overlaps the remaining
layers' compute. ``wait_for_save`` ends the step's transfers; a send settles when the
destination acknowledges a verified copy (every layer's CRC-64 checked) or fails, and only
then does ``get_finished`` let vLLM free the source blocks.

Decode: ``start_load_kv`` claims each :class:`~.scheduler_side.LoadSpec`'s transfer from the
sink it arrives on; ``get_finished`` writes every verified transfer into the request's
blocks and reports it. A transfer that fails verification, has the wrong shape or does not
arrive within its timeout is reported as failed blocks (``get_block_ids_with_load_errors``),
which vLLM recomputes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from topkv.errors import TopKVError
from topkv.integrations.vllm.connector.layout import (
    BlockLayout,
    gather_tokens,
    kv_views,
    scatter_tokens,
)
from topkv.integrations.vllm.connector.media import (
    ARENA_MEDIA,
    Offer,
    arena_sink,
    arena_source,
    offered_media,
)
from topkv.integrations.vllm.connector.params import ConnectorSettings, shm_socket_path
from topkv.integrations.vllm.connector.scheduler_side import LoadSpec, SaveSpec, StepPlan
from topkv.transport.base import (
    KVLayout,
    OutgoingTransfer,
    ReceivedKV,
    TransferDescriptor,
    TransferResult,
    TransferSink,
    TransferSource,
)
from topkv.transport.faults import CorruptingSource
from topkv.transport.shm import ShmSink, ShmSource
from topkv.transport.tcp import TcpSink, TcpSource
from topkv.wire import as_byte_view, crc64

log = logging.getLogger(__name__)

WIRE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _byte_view(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint8).numpy()


@dataclass
class _Send:
    spec: SaveSpec
    out: OutgoingTransfer
    started: float
    keep: list[np.ndarray] = field(default_factory=list)  # borrowed until the future settles
    layer_s: list[float] = field(default_factory=list)
    future: Future[TransferResult] | None = None


@dataclass
class _Recv:
    spec: LoadSpec
    future: Future[ReceivedKV]
    deadline: float


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, model_id: str, platform_layout: BlockLayout):
        self.settings = settings
        self.model_id = model_id
        self.layout = settings.block_layout or platform_layout
        self.caches: list[torch.Tensor] = []
        self.index: dict[str, int] = {}
        self.sinks: dict[str, TransferSink] = {}
        self._sources: dict[str, TransferSource] = {}
        self._sends: dict[str, _Send] = {}
        self._recvs: dict[str, _Recv] = {}
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self.stats = {"sent_bytes": 0, "received_bytes": 0, "failed_loads": 0}
        self.offer: Offer = offered_media(settings)

    # -- setup ----------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.index = {name: i for i, name in enumerate(kv_caches)}
        self.caches = list(kv_caches.values())
        k, _ = kv_views(self.caches[0], self.layout)  # checks the layout fits
        self.block_size, self.kv_heads, self.head_dim = k.shape[1], k.shape[2], k.shape[3]
        if self.caches[0].dtype not in WIRE_DTYPES:
            raise TopKVError(f"TopKVConnector: KV dtype {self.caches[0].dtype} has no wire type")
        self.dtype = WIRE_DTYPES[self.caches[0].dtype]
        if self.settings.role == "decode":
            s = self.settings
            media = self.offer.media
            if "tcp" in media:
                self.sinks["tcp"] = TcpSink(s.secret, s.tcp_host, s.tcp_port)
            if "shm" in media:
                path = shm_socket_path(s.shm_dir, s.worker_id)
                _remove_stale_socket(path)
                self.sinks["shm"] = ShmSink(s.secret, path)
            for medium in ARENA_MEDIA:
                if medium in media:
                    self.sinks[medium] = arena_sink(medium, s)
            log.info("topkv: decode sinks %s", [sink.address for sink in self.sinks.values()])
        if self.offer.unavailable:
            log.info("topkv: media not offered here: %s", self.offer.unavailable)

    def _source(self, spec: SaveSpec) -> TransferSource:
        medium = spec.destination.split(":", 1)[0]
        if medium not in self._sources:
            secret = self.settings.secret
            if medium == "shm":
                self._sources[medium] = ShmSource(secret)
            elif medium == "tcp":
                self._sources[medium] = TcpSource(secret)
            else:  # an arena medium: its agent starts on the first send over it
                self._sources[medium] = arena_source(medium, self.settings)
        if spec.corrupt:  # fault injection, asked for by this request
            return CorruptingSource(self._sources[medium], 1.0, seed=spec.transfer_id)
        return self._sources[medium]

    # -- prefill --------------------------------------------------------------------------

    def save_layer(self, plan: StepPlan, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self.index.get(layer_name)
        if layer is None:
            return
        for spec in plan.saves:
            send = self._sends.get(spec.req_id)
            if send is None:
                tokens = spec.num_tokens - spec.first_token
                layout = KVLayout(
                    len(self.caches), tokens, self.kv_heads, self.head_dim, self.dtype
                )
                descriptor = TransferDescriptor(spec.transfer_id, self.model_id, layout)
                try:
                    out = self._source(spec).open(descriptor, spec.destination)
                except TopKVError as exc:
                    log.warning("topkv: cannot send %s: %s", spec.req_id, exc)
                    continue
                send = self._sends[spec.req_id] = _Send(spec, out, time.perf_counter())
            if send.future is not None:
                continue
            k, v = gather_tokens(
                kv_layer, self.layout, spec.block_ids, spec.first_token, spec.num_tokens
            )
            views = [_byte_view(k.cpu()), _byte_view(v.cpu())]
            send.keep.extend(views)
            try:
                send.out.send_layer(
                    layer, [as_byte_view(x) for x in views], [crc64(view) for view in views]
                )
            except TopKVError as exc:
                log.warning("topkv: layer %d of %s: %s", layer, spec.req_id, exc)
                send.out.cancel()
            send.layer_s.append(time.perf_counter() - send.started)

    def end_saves(self, plan: StepPlan) -> None:
        for spec in plan.saves:
            send = self._sends.get(spec.req_id)
            if send is not None and send.future is None:
                send.future = send.out.finish()

    def _settled_sends(self) -> set[str]:
        done = set()
        for req_id, send in list(self._sends.items()):
            if req_id not in self._finished or send.future is None or not send.future.done():
                continue
            error = send.future.exception()
            if error is None:
                result = send.future.result()
                self.stats["sent_bytes"] += result.size_bytes
                log.info(
                    "topkv: sent %s: %d B over %s in %.1f ms, layers queued at %s ms",
                    req_id,
                    result.size_bytes,
                    result.medium,
                    result.seconds * 1e3,
                    [round(t * 1e3, 2) for t in send.layer_s],
                )
            else:
                log.warning("topkv: send of %s failed: %s", req_id, error)
            del self._sends[req_id]
            self._finished.discard(req_id)
            done.add(req_id)
        return done

    # -- decode ---------------------------------------------------------------------------

    def start_loads(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for spec in plan.loads:
            sink = self.sinks.get(spec.medium)
            if sink is None:
                self._fail(spec, f"no {spec.medium} sink here")
                continue
            future = sink.receive(spec.transfer_id)
            self._recvs[spec.req_id] = _Recv(spec, future, now + spec.timeout_s)

    def _fail(self, spec: LoadSpec, why: object) -> None:
        log.warning("topkv: load of %s failed (vLLM recomputes): %s", spec.req_id, why)
        self.stats["failed_loads"] += 1
        first, last = spec.start // self.block_size, -(-spec.num_tokens // self.block_size)
        self._errors.update(spec.block_ids[first:last])

    def _fill(self, spec: LoadSpec, kv: ReceivedKV) -> None:
        """Scatter tokens ``[spec.start, num_tokens)``; the transfer holds the prompt's last
        ``seq_len`` tokens (all of them, or a tail when the sender skipped a prefix it
        believed cached here)."""
        layout = kv.descriptor.layout
        expected = (len(self.caches), self.kv_heads, self.head_dim, self.dtype)
        got = (layout.num_layers, layout.kv_heads, layout.head_dim, layout.dtype)
        if got != expected or not 0 < layout.seq_len <= spec.num_tokens:
            raise TopKVError(
                f"transfer shape {(*got, layout.seq_len)} is not this request's "
                f"{(*expected, spec.num_tokens)}"
            )
        offset = spec.num_tokens - layout.seq_len  # the first token the transfer holds
        if offset > spec.start:
            raise TopKVError(
                f"the transfer starts at token {offset} but tokens {spec.start}..{offset - 1} "
                "are not cached here"
            )
        dtype = self.caches[0].dtype
        shape = (layout.seq_len, self.kv_heads, self.head_dim)
        for cache, (k, v) in zip(self.caches, kv.layers, strict=True):
            kt = torch.frombuffer(k, dtype=dtype).view(shape)[spec.start - offset :]
            vt = torch.frombuffer(v, dtype=dtype).view(shape)[spec.start - offset :]
            scatter_tokens(cache, self.layout, spec.block_ids, spec.start, kt, vt)
        self.stats["received_bytes"] += layout.total_bytes

    def _landed_loads(self) -> set[str]:
        done = set()
        now = time.monotonic()
        for req_id, recv in list(self._recvs.items()):
            if recv.future.done():
                try:
                    kv = recv.future.result()
                    try:
                        self._fill(recv.spec, kv)
                    finally:
                        kv.release()
                except Exception as exc:  # any failure of this one load: recompute it
                    self._fail(recv.spec, exc)
            elif now > recv.deadline:
                self._fail(recv.spec, f"no verified KV within {recv.spec.timeout_s} s")
                recv.future.add_done_callback(_release_late)
            else:
                continue
            del self._recvs[req_id]
            done.add(req_id)
        return done

    # -- both -----------------------------------------------------------------------------

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        self._finished.update(finished_req_ids)
        return self._settled_sends(), self._landed_loads()

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self, extra: Callable[[], None] | None = None) -> None:
        for send in self._sends.values():
            send.out.cancel()
        closables: list[TransferSink | TransferSource] = [*self.sinks.values()]
        for closable in [*closables, *self._sources.values()]:
            closable.close()
        if extra is not None:
            extra()


def _remove_stale_socket(path: str) -> None:
    """Unlink a socket left by a killed instance of the same worker id; refuse a live one."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: stale
        return
    finally:
        probe.close()
    raise TopKVError(f"{path}: another live instance listens here; give a distinct worker_id")


def _release_late(future: Future[ReceivedKV]) -> None:
    if future.exception() is None:
        future.result().release()


def default_layout(is_cpu: bool) -> BlockLayout:
    return BlockLayout.CPU_PACKED if is_cpu else BlockLayout.CUDA_SPLIT
