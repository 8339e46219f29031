"""The demo's summary: issue #19's emulation keys, the model check's floor, the text."""

from __future__ import annotations

from demo_results import result

from topkv.demo.emulation import DemoLinks, StandIn, resolve_dilation
from topkv.demo.report import summarize, summary_text
from topkv.demo.runner import DemoOptions
from topkv.harness.sim_check import sim_check
from topkv.harness.stand_in import Deployment

LINKS = DemoLinks("nvlink", 450e9, "rdma", 25e9)
STAND_IN = StandIn("Llama-3-70B", "4x-dgx-h100", 4, 4.43e9, 25e9, "nvlink", 450e9)


def _summary(
    dilation: float | None, exposed: float, modelled: float, warm_up_rate: float = 27e6
) -> dict[str, object]:
    results = [
        result(k, 380, 100.0 * k, exposed_ms=exposed, modelled_exposed_ms=modelled)
        for k in range(3)
    ]
    options = DemoOptions(requests=3, dilation=dilation)
    return summarize(
        results, options, 12.0, "m", resolve_dilation(dilation, STAND_IN, warm_up_rate, LINKS)
    )


def test_emulation_keys_and_types() -> None:
    summary = _summary(None, 5.0, 5.0)
    emulation = summary["emulation"]
    assert isinstance(emulation, dict)
    assert emulation["dilation"] == 41.0 and emulation["dilation_derived"] is True
    assert emulation["stand_in"] == {
        "model": "Llama-3-70B", "cluster": "4x-dgx-h100", "kv_bytes_per_prefill_s": 4430000000,
    }  # fmt: skip
    assert emulation["demo_kv_bytes_per_prefill_s"] == 27_000_000
    derivation = emulation["derivation"]
    assert derivation["derived_dilation"] == 41.0185 and derivation["stand_in_tp"] == 4
    # 3 x 380 tokens of the demo's KV in 3 x 171 ms of prefill: 27.3 MB/s in the run
    assert derivation["demo_kv_bytes_per_prefill_s_in_run"] == round(380 * 12288 / 0.171)
    assert "41x derived for Llama-3-70B" in emulation["dilation_note"]
    assert summary["pipelining"]["pipelined"] is True  # type: ignore[index]


def test_override_is_stated_in_the_text() -> None:
    summary = _summary(3000.0, 5.0, 5.0)
    assert summary["emulation"]["dilation_derived"] is False  # type: ignore[index]
    text = summary_text(summary).plain
    assert "emulated links: time dilation 3000x" in text
    assert "--dilation 3000x overrides the 41x derived" in text
    assert "no longer represents any deployment" in text


def test_model_check_floor_for_hidden_transfers() -> None:
    hidden = _summary(None, 0.0, 0.028)["model_check"]
    assert hidden["within_15pct"] is False  # type: ignore[index]
    assert hidden["within_tolerance"] is True  # type: ignore[index]
    off = _summary(None, 5.0, 7.0)["model_check"]  # 2 ms, 29%: a miss either way
    assert off["within_15pct"] is False and off["within_tolerance"] is False  # type: ignore[index]


def test_sim_check_lines_in_the_text() -> None:
    summary = _summary(None, 5.0, 5.0)
    results = [result(k, 380, 100.0 * k) for k in range(3)]
    summary["sim_check"] = sim_check(
        Deployment.parse("Llama-3-70B"), results, summary,
        pipelining=True, decode_slots=2, new_tokens=8,
    )  # fmt: skip
    text = summary_text(summary).plain
    assert "sim check (4x-dgx-h100 (demo-shaped), stand-in ms)" in text
    assert "demo vs sim" in text and ("AGREE" in text or "DISAGREE" in text)


def test_a_host_slower_in_the_run_than_in_the_warm_up_is_named() -> None:
    assert "in the warm-up" not in summary_text(_summary(None, 5.0, 5.0)).plain
    text = summary_text(_summary(None, 5.0, 5.0, warm_up_rate=81e6)).plain
    # the run made 27.3 MB/s, the warm-up 81: links were 3x too slow for the stand-in
    assert "27.3 MB of KV per second in the run, 81.0 in the warm-up" in text
    assert "was 3x the one the dilation was set for" in text
