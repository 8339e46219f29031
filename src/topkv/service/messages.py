"""JSON bodies exchanged between the orchestrator, the remote executor and workers.

Every body is a pydantic model so both sides validate what they read from the network and
the OpenAPI schema is generated from the same definitions. Every *request* body forbids
unknown fields and bounds its numbers, strings and lists (hostile input: docs/security.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from topkv.dtypes import KV_DTYPES
from topkv.relay.workers import Role, WorkerCapabilities, WorkerInfo
from topkv.transport.base import KVLayout

#: Largest KV cache a single request may ask a worker to hold (bounded allocations).
MAX_KV_BYTES = 64 << 30


class LayoutModel(BaseModel):
    """Shape of one request's KV cache (see :class:`topkv.transport.base.KVLayout`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(ge=1, le=1024)
    seq_len: int = Field(ge=1, le=10_000_000)
    kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=65536)
    dtype: Literal["fp8", "fp16", "bf16", "fp32"] = "fp16"
    latent: bool = False

    @model_validator(mode="after")
    def _bounded(self) -> LayoutModel:
        if self.to_layout().total_bytes > MAX_KV_BYTES:
            raise ValueError(
                f"KV cache of {self.to_layout().total_bytes} bytes exceeds the "
                f"{MAX_KV_BYTES} byte limit per request"
            )
        return self

    def to_layout(self) -> KVLayout:
        assert self.dtype in KV_DTYPES
        return KVLayout(
            self.num_layers, self.seq_len, self.kv_heads, self.head_dim, self.dtype, self.latent
        )

    @classmethod
    def of(cls, layout: KVLayout) -> LayoutModel:
        return cls.model_validate(
            {
                "num_layers": layout.num_layers,
                "seq_len": layout.seq_len,
                "kv_heads": layout.kv_heads,
                "head_dim": layout.head_dim,
                "dtype": layout.dtype,
                "latent": layout.latent,
            }
        )


class ErrorBody(BaseModel):
    """``{"error": {...}}``: what every non-2xx answer carries."""

    kind: str = Field(description="failure kind (FailureKind value) or HTTP error class")
    type: str = Field(description="exception type that caused it")
    detail: str


class ErrorResponse(BaseModel):
    error: ErrorBody


# -- worker control API ----------------------------------------------------------------------


#: Longest prompt (token ids) one prefill request may carry.
MAX_PROMPT_TOKENS = 1 << 20
#: A token id in a request (each engine checks it against its own vocabulary).
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
#: Longest medium name (tcp, shm, nixl, mooncake, cuda, emulated-<mode>).
MAX_MEDIUM_CHARS = 64


def _check_prompt(prompt: object, prompt_seed: int | None, prompt_tokens: int | None) -> None:
    """ValueError unless a prompt is given at most one way, ``prompt_seed`` with its length."""
    if prompt is not None and prompt_seed is not None:
        raise ValueError("give 'prompt' (token ids) or 'prompt_seed', not both")
    if prompt_seed is not None and prompt_tokens is None:
        raise ValueError("'prompt_seed' needs 'prompt_tokens' (the prompt's length)")
    if prompt_tokens is not None and prompt_seed is None:
        raise ValueError("'prompt_tokens' goes with 'prompt_seed'")


class PrefillRequest(BaseModel):
    """Ask a prefill worker to produce a request's KV with its engine.

    The synthetic engine takes ``model_id`` and ``layout`` (deterministic random bytes);
    a model engine (``--engine hf``) takes a prompt, as token ids (``prompt``) or as
    :func:`topkv.engine.prompt_token_ids` of ``prompt_tokens`` ids drawn from
    ``prompt_seed``, and derives the layout from its model (``model_id``, if given, must
    name the model it serves). ``wait``: answer once the KV is whole (``201``); false
    answers at once (``202``) while prefill runs, and a send started meanwhile streams each
    layer as the engine finishes it.
    """

    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(default="", max_length=200)
    layout: LayoutModel | None = None
    prompt: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    prompt_seed: int | None = Field(default=None, ge=0, lt=2**63)
    prompt_tokens: int | None = Field(default=None, ge=1, le=MAX_PROMPT_TOKENS)
    wait: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> PrefillRequest:
        _check_prompt(self.prompt, self.prompt_seed, self.prompt_tokens)
        if self.has_prompt and self.layout is not None:
            raise ValueError("a prompt's KV layout comes from the worker's model; omit 'layout'")
        if not self.has_prompt and (self.layout is None or not self.model_id):
            raise ValueError("give 'model_id' and 'layout', or a prompt ('prompt'/'prompt_seed')")
        return self

    @property
    def has_prompt(self) -> bool:
        return self.prompt is not None or self.prompt_seed is not None


class KVSummary(BaseModel):
    """A KV cache a worker holds."""

    request_id: int
    model_id: str
    layout: LayoutModel
    size_bytes: int
    digest: int = Field(
        description="kv_digest of the held bytes (CRC-64 of each tensor); 0 while prefill "
        "is still producing them (complete false)"
    )
    origin: Literal["prefill", "received"]
    medium: str = ""
    complete: bool = Field(default=True, description="false while prefill is still running")
    first_token: int | None = Field(
        default=None, description="the token prefill produced (model engines)"
    )
    kept: bool = Field(
        default=True,
        description="false for a drained copy (ReceiveRequest keep=false): verified, "
        "timestamped and released at once; its digest is not computed (0)",
    )
    timings: KVTimings = Field(default_factory=lambda: KVTimings())


#: A ``time.perf_counter()`` stamp of the worker that took it. On Linux that is
#: CLOCK_MONOTONIC, one clock for every process of a host, so stamps of workers on one host
#: compare directly; across hosts they do not.
Stamp = float


class KVTimings(BaseModel):
    """When a worker produced or received a KV cache (stamps: :data:`Stamp`; None: not
    measured, e.g. a medium whose sink reports no per-layer arrival)."""

    forward_start_s: Stamp | None = Field(
        default=None, description="the engine took the prefill (its forward pass began)"
    )
    forward_end_s: Stamp | None = None
    layer_ready_s: list[Stamp] = Field(
        default_factory=list, description="layer l's K/V published to sends (prefill)"
    )
    arrivals_s: list[Stamp | None] = Field(
        default_factory=list, description="layer l landed, its CRC-64 checked (received)"
    )
    verified_s: Stamp | None = Field(
        default=None, description="the whole copy was verified (received)"
    )


class DecodeRequest(BaseModel):
    """Continue generation from a held KV (model engines): greedy, no EOS stop."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(ge=1, le=4096)
    first_token: TokenId | None = Field(
        default=None, description="prefill's token; omit when this worker ran the prefill itself"
    )


class DecodeResult(BaseModel):
    """``max_new_tokens`` greedy tokens, the first being prefill's."""

    request_id: int
    model_id: str
    prompt_len: int
    tokens: list[int]
    seconds: float
    started_s: Stamp = 0.0
    ended_s: Stamp = 0.0
    #: KV tiers (a worker with --device-kv-capacity): the tiers this KV visited in order,
    #: the time its promotions took and the part of it decode waited for.
    tiers: list[str] | None = None
    promotion_ms: float | None = None
    exposed_promotion_ms: float | None = None
    tier_failures: list[str] | None = None


class GenerateRequest(BaseModel):
    """Generate from a prompt inside this worker alone (prefill and decode, no transfer):
    the single-process reference a disaggregated run's tokens are compared with."""

    model_config = ConfigDict(extra="forbid")
    prompt: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    prompt_seed: int | None = Field(default=None, ge=0, lt=2**63)
    prompt_tokens: int | None = Field(default=None, ge=1, le=MAX_PROMPT_TOKENS)
    max_new_tokens: int = Field(ge=1, le=4096)

    @model_validator(mode="after")
    def _a_prompt(self) -> GenerateRequest:
        _check_prompt(self.prompt, self.prompt_seed, self.prompt_tokens)
        if self.prompt is None and self.prompt_seed is None:
            raise ValueError("give a prompt: 'prompt' (token ids) or 'prompt_seed'")
        return self

    def prefill_request(self) -> PrefillRequest:
        return PrefillRequest(
            prompt=self.prompt, prompt_seed=self.prompt_seed, prompt_tokens=self.prompt_tokens
        )


class GenerateResult(BaseModel):
    model_id: str
    prompt_len: int
    tokens: list[int]
    seconds: float


class ReceiveRequest(BaseModel):
    """Tell a destination to expect a request's KV over ``medium``; it answers the address."""

    model_config = ConfigDict(extra="forbid")

    request_id: int = Field(ge=0, lt=2**63)
    model_id: str = Field(min_length=1, max_length=200)
    layout: LayoutModel
    medium: str = Field(min_length=1, max_length=MAX_MEDIUM_CHARS)
    keep: bool = Field(
        default=True,
        description="false: drain the copy (verify, timestamp, release; a measurement)",
    )


class ReceiveReady(BaseModel):
    request_id: int
    medium: str
    address: str


class WaitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(gt=0, le=3600)


class SendRequest(BaseModel):
    """Tell a source to stream a held KV cache to ``destination`` over ``medium``."""

    model_config = ConfigDict(extra="forbid")

    request_id: int = Field(ge=0, lt=2**63)
    destination: str = Field(
        min_length=1, max_length=2048, description="sink address from /v1/receive"
    )
    medium: str = Field(min_length=1, max_length=MAX_MEDIUM_CHARS)
    timeout_s: float = Field(gt=0, le=3600)
    transfer_id: int | None = Field(
        default=None,
        ge=0,
        lt=2**63,
        description="the id the copy travels (and is received) as; default request_id",
    )
    link: PacedLink | None = Field(
        default=None, description="pace this send to an emulated path (one link per send)"
    )
    schedule: Literal["stream", "serial", "replay"] = Field(
        default="stream",
        description="stream: each layer as prefill publishes it (all at once when whole); "
        "serial: wait until whole, then send; replay: wait until whole, then send layer l "
        "at start + (ready_l - forward_start), replaying prefill's schedule",
    )


class PacedLink(BaseModel):
    """The emulated path a send is paced to (see :mod:`topkv.transport.emulated`)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["nvlink", "nvswitch", "pcie", "rdma", "tcp"]
    bandwidth_gbps: float = Field(gt=0, le=1e6)
    setup_s: float = Field(ge=0, le=60)
    dilation: float = Field(default=1.0, ge=1, le=1e9)


class SendResult(BaseModel):
    """The sender's view of a verified, acknowledged transfer."""

    request_id: int
    medium: str
    mode: str
    size_bytes: int
    seconds: float
    wall_seconds: float
    emulated: bool
    dilation: float
    transfer_id: int = -1
    started_s: Stamp = 0.0
    ended_s: Stamp = Field(default=0.0, description="the destination acknowledged")
    offered_s: list[Stamp] = Field(
        default_factory=list, description="layer l offered to the (paced) transport"
    )
    handed_s: list[Stamp] = Field(
        default_factory=list, description="layer l left the paced link for the real medium"
    )


class Released(BaseModel):
    request_id: int
    released: bool


# -- a worker changing pools (the Adaptive Decoder Pool: topkv.service.worker.role) ---------


class RoleRequest(BaseModel):
    """``POST /v1/role``: serve in the ``role`` pool from now on."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    chunk_tokens: int = Field(
        default=512, ge=1, le=1 << 20, description="chunk size of chunked prefill"
    )
    reserved_slots: int = Field(
        default=0, ge=0, le=1 << 20, description="decode sequences a converted worker may keep"
    )
    drain: bool = Field(
        default=False,
        description="wait for decode sequences beyond reserved_slots to finish (else 409)",
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, le=600)


class ChunkedPrefill(BaseModel):
    """The prefill mode of a converted decode worker."""

    chunk_tokens: int
    reserved_slots: int


class RoleAnswer(BaseModel):
    worker_id: str
    native: Role
    previous: Role
    role: Role
    changed: bool
    seconds: float = Field(description="the worker's own time: checks, drain, re-registration")
    kept_decode: int = Field(description="decode sequences (received KV) it still holds")
    chunked_prefill: ChunkedPrefill | None = None


# -- worker registration through the orchestrator --------------------------------------------


Text = Annotated[str, Field(max_length=256)]


class RegisteredCapabilities(WorkerCapabilities):
    """:class:`WorkerCapabilities` as a registration may give them: no unknown field, at most
    32 media names."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    media: tuple[Annotated[str, Field(min_length=1, max_length=MAX_MEDIUM_CHARS)], ...] = Field(
        default=(), max_length=32
    )


class RegisteredWorker(WorkerInfo):
    """The bounds a worker record registered over HTTP must keep (checked, then the record is
    kept as the :class:`WorkerInfo` it is). :class:`WorkerInfo` itself stays open to fields it
    does not know: registries hold records that newer workers may have written."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str = Field(min_length=1, max_length=256)
    host_id: Text = ""
    gpus: tuple[Annotated[int, Field(ge=0, lt=2**31)], ...] = Field(default=(), max_length=1024)
    nvlink_domain: Text | None = None
    capabilities: RegisteredCapabilities = RegisteredCapabilities()
    capacity: int = Field(default=8, ge=0, le=1_000_000)
    address: str = Field(default="", max_length=512)
    control_url: str = Field(default="", max_length=2048)


class RegisterRequest(BaseModel):
    """A worker registering with an orchestrator that keeps an embedded registry."""

    model_config = ConfigDict(extra="forbid")

    worker: WorkerInfo
    ttl_s: float = Field(default=10.0, gt=0, le=3600)

    @field_validator("worker", mode="before")
    @classmethod
    def _bounded(cls, value: object) -> object:
        RegisteredWorker.model_validate(
            value.model_dump() if isinstance(value, WorkerInfo) else value
        )
        return value
