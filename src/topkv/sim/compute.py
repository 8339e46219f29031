"""Roofline compute model: prefill from FLOPs, decode steps from bytes moved.

* Prefill of a batch of prompts on one instance of ``tp`` GPUs::

      flops = 2 * active_params * tokens + attention_flops
      attention_flops = 4 * layers * heads * head_dim * sum(s_i**2) / 2   (causal)
      t = max(flops / (tp * peak_flops * mfu), weight_bytes / (tp * hbm_bw * mbu))

* One decode step of a batch of ``b`` sequences holding ``K`` cached tokens in total::

      bytes = weight_bytes_touched(b) + kv_bytes_per_token * K
      t = max(bytes / (tp * hbm_bw * mbu), 2 * active_params * b / (tp * peak_flops * mfu))

  ``weight_bytes_touched`` is all weights for a dense model, and for a mixture of experts
  the shared part plus the experts a batch of ``b`` tokens activates (at most all of them).

Peak figures are dense (no sparsity) BF16 tensor-core throughput and HBM bandwidth from the
vendors' datasheets (see :data:`GPU_SPECS`). ``mfu`` / ``mbu`` are the achieved fractions
(defaults 0.5 and 0.8, typical of vLLM/TensorRT-LLM serving). Measured times override the
model through :meth:`ComputeModel.calibrated`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from topkv.kv.spec import ModelSpec
from topkv.sim.errors import SimError


@dataclass(frozen=True)
class GPUSpec:
    """Peak dense BF16 FLOP/s, HBM bandwidth (bytes/s) and capacity (bytes) of one GPU."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    source: str


GPU_SPECS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        GPUSpec(
            "H100",
            989e12,
            3.35e12,
            80e9,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 1,979 TFLOPS with sparsity, "
            "i.e. 989 dense; HBM3 80 GB at 3.35 TB/s)",
        ),
        GPUSpec(
            "H200",
            989e12,
            4.8e12,
            141e9,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM: BF16 1,979 TFLOPS sparse / 989 "
            "dense; HBM3e 141 GB at 4.8 TB/s)",
        ),
        GPUSpec(
            "B200",
            2.25e15,
            8.0e12,
            180e9,
            "NVIDIA HGX B200 datasheet (per GPU: BF16 4.5 PFLOPS sparse / 2.25 dense; HBM3e "
            "180 GB at 8 TB/s)",
        ),
        GPUSpec(
            "GB200",
            2.5e15,
            8.0e12,
            186e9,
            "NVIDIA GB200 NVL72 datasheet (rack: 360 PFLOPS BF16 sparse, 13.4 TB HBM3e, "
            "576 TB/s; divided by 72 GPUs: 2.5 PFLOPS dense, 186 GB, 8 TB/s)",
        ),
        GPUSpec(
            "A100",
            312e12,
            2.039e12,
            80e9,
            "NVIDIA A100 Tensor Core GPU datasheet (SXM 80 GB: BF16 312 TFLOPS dense; "
            "HBM2e 2,039 GB/s)",
        ),
        GPUSpec(
            "L40S",
            362.05e12,
            864e9,
            48e9,
            "NVIDIA L40S datasheet (BF16 362.05 TFLOPS dense / 733 sparse; 48 GB GDDR6 at "
            "864 GB/s)",
        ),
    )
}


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU type up by name (case-insensitive)."""
    for key, spec in GPU_SPECS.items():
        if key.lower() == name.strip().lower():
            return spec
    raise SimError(f"unknown GPU type {name!r}; known: {', '.join(GPU_SPECS)}")


@dataclass(frozen=True)
class ComputeModel:
    """Prefill and decode times of one model on one instance of ``tp`` GPUs.

    ``prefill_scale`` / ``decode_scale`` multiply the roofline times (1.0 = uncalibrated);
    :meth:`calibrated` derives them from measurements. ``prefill_s_per_token`` replaces the
    prefill roofline by a fixed per-token time when set (used by the queueing validation
    and for a measured linear fit).
    """

    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    weight_bytes_per_param: float = 2.0
    kv_dtype: str = "fp16"
    mfu: float = 0.5
    mbu: float = 0.8
    memory_fraction: float = 0.9
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    prefill_s_per_token: float | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise SimError(f"tensor parallelism must be >= 1, got {self.tp}")
        for name in ("mfu", "mbu", "memory_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise SimError(f"{name} must be in (0, 1], got {value}")
        if self.prefill_scale <= 0 or self.decode_scale <= 0:
            raise SimError("calibration scales must be > 0")
        if self.kv_capacity_bytes <= 0:
            raise SimError(
                f"{self.model.name} ({self.weight_bytes / 1e9:.0f} GB of weights) does not fit "
                f"on {self.tp} x {self.gpu.name} ({self.gpu.hbm_bytes / 1e9:.0f} GB each, "
                f"{self.memory_fraction:.0%} usable); raise the tensor parallelism"
            )

    # -- sizes ---------------------------------------------------------------------------

    @property
    def total_params(self) -> float:
        return float(self.model.num_params or _estimate_params(self.model))

    @property
    def active_params(self) -> float:
        return float(self.model.active_params or self.total_params)

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.kv_dtype)

    @property
    def kv_capacity_bytes(self) -> float:
        """HBM left for KV caches on the whole instance."""
        return self.tp * self.gpu.hbm_bytes * self.memory_fraction - self.weight_bytes

    def kv_bytes(self, tokens: int) -> int:
        """KV-cache bytes of one sequence of ``tokens`` tokens (whole instance)."""
        return self.model.kv_bytes(tokens, self.kv_dtype)

    # -- times ---------------------------------------------------------------------------

    def prefill_s(self, prompt_tokens: list[int] | tuple[int, ...]) -> float:
        """Time to prefill a batch of prompts together."""
        total = sum(prompt_tokens)
        if self.prefill_s_per_token is not None:
            return self.prefill_s_per_token * total * self.prefill_scale
        model = self.model
        attn_width = model.num_attention_heads * model.head_dim
        full_layers = model.layer_types.count("full")
        quad = sum(s * s for s in prompt_tokens)
        attn_flops = 2.0 * full_layers * attn_width * quad  # QK^T and AV, causal half
        flops = 2.0 * self.active_params * total + attn_flops
        compute_s = flops / (self.tp * self.gpu.peak_flops * self.mfu)
        memory_s = self.weight_bytes / (self.tp * self.gpu.hbm_bandwidth * self.mbu)
        return max(compute_s, memory_s) * self.prefill_scale

    def decode_step_s(self, batch: int, cached_tokens: float) -> float:
        """One decode step for ``batch`` sequences holding ``cached_tokens`` in total."""
        if batch <= 0:
            return 0.0
        touched = self._weights_touched(batch)
        nbytes = touched + self.kv_bytes_per_token * cached_tokens
        memory_s = nbytes / (self.tp * self.gpu.hbm_bandwidth * self.mbu)
        compute_s = 2.0 * self.active_params * batch / (self.tp * self.gpu.peak_flops * self.mfu)
        return max(memory_s, compute_s) * self.decode_scale

    def _weights_touched(self, batch: int) -> float:
        if self.active_params >= self.total_params:
            return self.weight_bytes
        per_token = self.active_params * self.weight_bytes_per_param
        return min(self.weight_bytes, per_token * batch)

    # -- calibration ---------------------------------------------------------------------

    def calibrated(
        self,
        per_layer_ms: float | None = None,
        at_tokens: int = 1024,
        decode_step_ms: float | None = None,
        at_batch: int = 1,
        at_cached_tokens: int = 1024,
    ) -> ComputeModel:
        """A copy whose times match measurements.

        ``per_layer_ms`` is a measured prefill time per layer for one prompt of
        ``at_tokens`` tokens (e.g. from the live demo's per-layer timings);
        ``decode_step_ms`` a measured decode step with ``at_batch`` sequences holding
        ``at_cached_tokens`` tokens. The roofline's shape (how time grows with tokens and
        batch) is kept; its scale is fitted to the measured point.
        """
        prefill_scale = self.prefill_scale
        decode_scale = self.decode_scale
        if per_layer_ms is not None:
            if per_layer_ms <= 0 or at_tokens <= 0:
                raise SimError("per_layer_ms and at_tokens must be > 0")
            base = replace(self, prefill_scale=1.0).prefill_s([at_tokens])
            measured = per_layer_ms * 1e-3 * self.model.num_layers
            prefill_scale = measured / base
        if decode_step_ms is not None:
            if decode_step_ms <= 0 or at_batch <= 0:
                raise SimError("decode_step_ms and at_batch must be > 0")
            base = replace(self, decode_scale=1.0).decode_step_s(at_batch, at_cached_tokens)
            decode_scale = decode_step_ms * 1e-3 / base
        return replace(self, prefill_scale=prefill_scale, decode_scale=decode_scale)


def _estimate_params(model: ModelSpec) -> float:
    """Dense parameter count from shapes when the catalog does not give one."""
    h = model.hidden_size
    attn = h * model.num_attention_heads * model.head_dim * 2
    attn += h * max(model.num_kv_heads, 1) * model.head_dim * 2
    mlp = 3 * h * model.intermediate_size
    return float(model.num_layers * (attn + mlp) + 2 * model.vocab_size * h)


def default_tp(model: ModelSpec, gpu: GPUSpec, weight_bytes_per_param: float = 2.0) -> int:
    """Smallest power-of-two TP whose weights take at most half of the instance's HBM."""
    params = float(model.num_params or _estimate_params(model))
    tp = 1
    while params * weight_bytes_per_param > 0.5 * tp * gpu.hbm_bytes and tp < 64:
        tp *= 2
    return tp
