"""Messages between the demo's main process and its worker processes (pickled over queues).

Every timestamp is ``time.perf_counter()`` of the process that took it. On Linux that is
``CLOCK_MONOTONIC``, one clock for every process of the host, so stamps taken by the prefill
worker (layer ready), the decode worker (layer landed) and the main process (arrival) are
directly comparable; :func:`topkv.demo.cluster.check_shared_clock` refuses to run otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from topkv.engine.spec import DemoModelConfig

Schedule = Literal["stream", "serial", "replay"]
ExpectKind = Literal["decode", "drain"]
#: Who keeps a prefill worker's KV alive: the relay orchestrator (until it released the
#: source after a verified delivery) and the demo's baselines (serial and replay sends).
HOLDERS = ("relay", "baselines")


@dataclass(frozen=True)
class DemoWorkerConfig:
    worker_id: str
    role: Literal["prefill", "decode"]
    main_pid: int
    secret: bytes
    model: DemoModelConfig
    seed: int
    model_path: str | None = None
    torch_threads: int = 1
    io_timeout_s: float = 60.0


@dataclass(frozen=True)
class LinkSpec:
    """The emulated path a transfer is paced to (see :mod:`topkv.transport.emulated`)."""

    mode: str
    bandwidth_gbps: float
    setup_s: float
    dilation: float


# -- main -> prefill worker ------------------------------------------------------------


@dataclass(frozen=True)
class Prefill:
    """Run the prompt's forward pass once; hold its KV until every holder released it."""

    rid: int
    prompt_len: int
    prompt_seed: int
    holders: tuple[str, ...] = HOLDERS


@dataclass(frozen=True)
class Send:
    """Send ``rid``'s KV to ``destination`` as transfer ``wire_rid``.

    ``stream``: each layer as soon as prefill publishes it (the pipelined transfer);
    ``serial``: every layer after prefill ended (the whole cache at once);
    ``replay``: layer ``l`` at ``t0 + (ready_l - forward_start)``, replaying the recorded
    compute schedule over another path (the uniform-RDMA comparison).
    """

    rid: int
    tag: str
    wire_rid: int
    medium: str  # "shm" or "tcp": the real medium
    destination: str
    link: LinkSpec | None
    schedule: Schedule
    first_token_to: str | None = None  # decode worker that gets the first token (stream)
    timeout_s: float = 60.0


@dataclass(frozen=True)
class CancelSend:
    """Abandon the outgoing transfer ``wire_rid`` (the orchestrator cancelled the attempt)."""

    rid: int
    wire_rid: int


@dataclass(frozen=True)
class Release:
    """``holder`` no longer needs ``rid``'s KV; the worker frees it once all holders did."""

    rid: int
    holder: str = "relay"


@dataclass(frozen=True)
class Stop:
    pass


# -- main / prefill -> decode worker ---------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """Receive transfer ``wire_rid`` on ``medium``.

    ``decode``: verify it, report its digest (:class:`Held`) and hold it until told to
    :class:`Take` it for decode (or to :class:`Discard` it); ``drain``: verify, stamp and
    drop it (the baselines' copies).
    """

    rid: int
    tag: str
    wire_rid: int
    medium: str
    kind: ExpectKind
    prompt_len: int
    max_new_tokens: int = 0
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Take:
    """The orchestrator verified and handed off ``wire_rid``: decode it (with prefill's
    first token, which the prefill worker sends straight to the decode worker)."""

    rid: int
    wire_rid: int


@dataclass(frozen=True)
class Discard:
    """Drop the copy of ``rid`` held (or still arriving) as ``wire_rid``; all when None."""

    rid: int
    wire_rid: int | None = None


@dataclass(frozen=True)
class Reference:
    """Single-process greedy generation of the same prompt (the correctness oracle)."""

    rid: int
    prompt_len: int
    prompt_seed: int
    max_new_tokens: int


@dataclass(frozen=True)
class FirstToken:
    rid: int
    token: int
    sent_s: float


# -- worker -> main --------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    worker_id: str
    pid: int
    model_id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    addresses: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillDone:
    worker_id: str
    rid: int
    first_token: int
    started_s: float  # the worker picked the request up
    forward_start_s: float
    forward_end_s: float
    layer_ready_s: tuple[float, ...]  # layer l's K/V stored and offered to senders
    layer_compute_s: tuple[float, ...]  # the layer's own forward time (hooks)
    digest: int = 0  # relay.executor.kv_digest of the KV it holds


@dataclass(frozen=True)
class SendDone:
    worker_id: str
    rid: int
    tag: str
    start_s: float
    end_s: float  # the destination acknowledged a verified copy
    offered_s: tuple[float, ...]  # layer l offered to the (paced) transport
    handed_s: tuple[float, ...]  # layer l left the paced link, handed to the medium
    nbytes: int
    transport: str
    emulated: bool
    dilation: float
    error: str | None = None
    wire_rid: int = -1
    failure: str | None = None  # relay FailureKind value of ``error``


@dataclass(frozen=True)
class Held:
    """A verified copy of ``wire_rid`` now held by a decode worker, awaiting Take/Discard."""

    worker_id: str
    rid: int
    wire_rid: int
    digest: int  # relay.executor.kv_digest over the bytes it holds
    arrivals_s: tuple[float, ...]
    verified_s: float
    error: str | None = None
    failure: str | None = None  # relay FailureKind value of ``error``


@dataclass(frozen=True)
class Received:
    """A drained transfer (serial or replay copy): verified, timestamped and released."""

    worker_id: str
    rid: int
    tag: str
    arrivals_s: tuple[float, ...]  # layer l landed and its CRC-64 matched
    verified_s: float  # the whole KV was acknowledged verified
    error: str | None = None


@dataclass(frozen=True)
class Decoded:
    worker_id: str
    rid: int
    tokens: tuple[int, ...]
    arrivals_s: tuple[float, ...]
    kv_verified_s: float
    first_token_s: float
    decode_start_s: float
    decode_end_s: float
    error: str | None = None


@dataclass(frozen=True)
class ReferenceDone:
    worker_id: str
    rid: int
    tokens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class Failed:
    """A job failed inside a worker (the message says which and why)."""

    worker_id: str
    rid: int
    message: str


Event = Ready | PrefillDone | SendDone | Held | Received | Decoded | ReferenceDone | Failed
