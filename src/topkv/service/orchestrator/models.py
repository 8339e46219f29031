"""Request and response bodies of the orchestrator's HTTP API (also its OpenAPI schemas)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from topkv.errors import ConfigError
from topkv.kv.catalog import get_model
from topkv.relay.workers import WorkerInfo
from topkv.service.messages import MAX_MEDIUM_CHARS, MAX_PROMPT_TOKENS, LayoutModel, TokenId


class SubmitRequest(BaseModel):
    """``POST /v1/requests``: a prefilled request whose KV must reach a decode worker.

    Give the KV shape either as ``layout`` or as ``prompt_tokens`` of a catalog ``model``
    whose layers all use full attention (others need an explicit ``layout``). A *prompt
    request* instead gives ``prompt`` (token ids) or ``prompt_seed`` with ``prompt_tokens``
    (its length) for a prefill worker that serves a model (``topkv worker --engine hf``):
    ``model`` names that model, the worker's model gives the layout, its prefill streams
    each layer to the decode worker as it is computed, and ``new_tokens`` > 0 has the decode
    worker generate that many tokens from the KV it received (``decode_check.tokens``).
    """

    model_config = ConfigDict(extra="forbid")

    request_id: int | None = Field(
        default=None, ge=0, lt=2**63, description="omit to let the orchestrator number it"
    )
    model: str = Field(min_length=1, max_length=200)
    prompt_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    dtype: Literal["fp8", "fp16", "bf16", "fp32"] = "fp16"
    layout: LayoutModel | None = None
    source: str | None = Field(
        default=None, max_length=128, description="prefill worker id; omit to pick one round-robin"
    )
    prefill: bool = Field(
        default=True,
        description="ask the source to produce the KV first (synthetic stand-in for a "
        "model's prefill); false when the source already holds it",
    )
    transport: str | None = Field(
        default=None, max_length=64, description="manual transport override"
    )
    medium: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_MEDIUM_CHARS,
        description="force the medium that moves the bytes (tcp, shm, nixl, mooncake, cuda, "
        "emulated-<mode>); both workers must offer it",
    )
    prompt: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    prompt_seed: int | None = Field(default=None, ge=0, lt=2**63)
    new_tokens: int = Field(
        default=0, ge=0, le=4096, description="tokens the decode worker generates (prompts)"
    )

    @model_validator(mode="after")
    def _one_shape(self) -> SubmitRequest:
        if self.is_prompt:
            if self.prompt is not None and self.prompt_seed is not None:
                raise ValueError("give 'prompt' (token ids) or 'prompt_seed', not both")
            if self.layout is not None:
                raise ValueError("a prompt's layout comes from the prefill worker's model")
            if (self.prompt_seed is None) != (self.prompt_tokens is None) or (
                self.prompt is not None and self.prompt_tokens is not None
            ):
                raise ValueError("'prompt_seed' goes with 'prompt_tokens' (its length)")
            if not self.prefill:
                raise ValueError("a prompt request is prefilled by its source: 'prefill' true")
            return self
        if (self.layout is None) == (self.prompt_tokens is None):
            raise ValueError("give exactly one of 'layout' or 'prompt_tokens'")
        if self.new_tokens:
            raise ValueError("'new_tokens' needs a prompt ('prompt' or 'prompt_seed')")
        return self

    @property
    def is_prompt(self) -> bool:
        return self.prompt is not None or self.prompt_seed is not None

    def resolved_layout(self) -> LayoutModel:
        """The KV layout: as given, or derived from the catalog model and prompt length."""
        if self.layout is not None:
            return self.layout
        assert self.prompt_tokens is not None
        spec = get_model(self.model)  # raises UnknownModelError listing known names
        if any(t != "full" for t in spec.layer_types):
            raise ConfigError(
                f"model {spec.name!r} mixes layer types {sorted(set(spec.layer_types))}; "
                "its per-layer KV sizes differ, so give an explicit 'layout'"
            )
        if spec.attention == "mla":
            heads, dim, latent = 1, spec.kv_lora_rank + spec.qk_rope_head_dim, True
        else:
            heads, dim, latent = spec.num_kv_heads, spec.head_dim, False
        try:
            return LayoutModel(
                num_layers=spec.num_layers,
                seq_len=self.prompt_tokens,
                kv_heads=heads,
                head_dim=dim,
                dtype=self.dtype,
                latent=latent,
            )
        except ValidationError as exc:  # e.g. a KV cache over the per-request limit: a 400
            problems = "; ".join(e["msg"] for e in exc.errors(include_url=False))
            raise ConfigError(
                f"model {spec.name!r} with {self.prompt_tokens} prompt tokens: {problems}"
            ) from None


class AttemptView(BaseModel):
    number: int
    destination: str
    transport: str
    medium: str
    started_at: float
    ended_at: float | None
    error: str | None
    detail: str


class TransferView(BaseModel):
    """One request's transfer record (``GET /v1/requests/{id}``, ``GET /v1/transfers``)."""

    request_id: int
    model_id: str
    source: str
    destination: str | None
    state: Literal["queued", "planned", "running", "verifying", "delivered", "failed", "cancelled"]
    transport: str | None = Field(description="path class chosen by the selection policy")
    medium: str = Field(description="what moved the bytes: shm, tcp or emulated-<mode>")
    emulated: bool
    policy: str
    rationale: str
    size_bytes: int
    layers: int
    submitted_at: float
    handed_off_at: float | None
    ended_at: float | None
    transfer_seconds: float | None
    retries: int
    failovers: int
    reroutes: int
    outcome: str | None
    failure: str | None
    reason: str
    attempts: list[AttemptView]
    source_digest: int | None = None
    decode_check: DecodeCheck | None = None


class DecodeCheck(BaseModel):
    """What the decode stand-in found when it took a delivered KV from its worker."""

    worker: str
    digest: int | None
    matches_source: bool
    detail: str = ""
    tokens: list[int] | None = Field(
        default=None, description="tokens the decode worker generated (prompt requests)"
    )


class TransferList(BaseModel):
    counts: dict[str, int]
    in_flight: int
    queued: int
    transfers: list[TransferView]


class WorkerView(BaseModel):
    """A registered worker plus the decode slots the orchestrator has reserved on it."""

    worker: WorkerInfo
    slots_used: int


class WorkerList(BaseModel):
    registry: str
    workers: list[WorkerView]


class Health(BaseModel):
    ok: bool
    detail: str = ""


class Readiness(BaseModel):
    ready: bool
    running: bool
    registry_reachable: bool
    prefill_workers: int
    decode_workers: int
    detail: str = ""


class PathView(BaseModel):
    transport: str
    bandwidth_gbps: float
    setup_latency_s: float
    links: list[str]


class PairPaths(BaseModel):
    source: str
    destination: str
    same_node: bool
    same_host: bool
    candidates: list[PathView]


class TopologyView(BaseModel):
    """Where the orchestrator's path figures come from, and each prefill->decode pair."""

    source: Literal["file", "registrations"]
    topology_file: str | None
    cluster: dict[str, object] | None
    pairs: list[PairPaths]


class HeartbeatAck(BaseModel):
    worker_id: str
    ok: bool


TransferView.model_rebuild()
