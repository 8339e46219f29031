"""Demo request figures for the tests of what is computed from them (summary, sim check)."""

from __future__ import annotations

from topkv.demo.results import RequestResult

#: KV bytes per prompt token of the demo's model: K and V, 12 layers, 2 KV heads of 64
#: float32 values.
BYTES_PER_TOKEN = 2 * 12 * 2 * 64 * 4


def result(
    rid: int,
    prompt_len: int,
    arrival_ms: float,
    *,
    exposed_ms: float = 5.0,
    modelled_exposed_ms: float = 5.0,
    error: str | None = None,
) -> RequestResult:
    """A request as a run reports it (0.45 ms of CPU prefill per token, as on a quiet host)."""
    return RequestResult(
        id=rid, transport="nvlink", medium="shm", prefill_worker="prefill0",
        decode_worker="decode0", prompt_len=prompt_len, trace_prompt_tokens=prompt_len,
        bytes=prompt_len * BYTES_PER_TOKEN, arrival_ms=arrival_ms, queue_ms=1.0,
        decode_ms=50.0, prefill_ms=0.45 * prompt_len, transfer_ms=0.45 * prompt_len,
        exposed_ms=exposed_ms, modelled_exposed_ms=modelled_exposed_ms, serial_ms=70.0,
        ttft_ms=200.0, uniform_rdma_exposed_ms=6.0, uniform_rdma_ttft_ms=201.0,
        tokens_identical=error is None, emulated=True, dilation=40.0, error=error,
    )  # fmt: skip
