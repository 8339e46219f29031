"""The connector's scheduler half on its own (no vLLM): when a prompt is streamed, what a
load covers, how a failed load is reported back, and the parameters it refuses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from topkv.integrations.vllm.connector.params import ConnectorConfigError, ConnectorSettings
from topkv.integrations.vllm.connector.scheduler_side import SchedulerSide

PER_TOKEN = 4096


@pytest.fixture
def settings(tmp_path: Path) -> ConnectorSettings:
    (tmp_path / "secret").write_text("x" * 32)
    return ConnectorSettings.from_extra({"secret_file": str(tmp_path / "secret")}, "kv_producer")


def _request(req_id: str, prompt: int, params: dict[str, object]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=list(range(prompt)), kv_transfer_params=params
    )


def _step(new: list[tuple[str, int]], cached: list[tuple[str, int]]) -> tuple[object, object]:
    new_reqs = [SimpleNamespace(req_id=r, num_computed_tokens=0) for r, _ in new]
    cached_reqs = SimpleNamespace(
        req_ids=[r for r, _ in cached], num_computed_tokens=[done for _, done in cached]
    )
    return new_reqs, cached_reqs


def test_a_chunked_prompt_is_streamed_once_its_last_chunk_is_computed(
    settings: ConnectorSettings,
) -> None:
    side = SchedulerSide(settings, block_size=32, bytes_per_token=PER_TOKEN)
    send = {"do_remote_decode": True, "topkv": {"transfer_id": 5, "destination": "tcp://h:1"}}
    request = _request("r", 100, send)
    side.after_alloc(request, [3, 1, 4, 0], 0)
    assert side.num_new_matched_tokens(request, 0) == (0, False)  # a prefill loads nothing

    def blocks(_req_id: str) -> list[int]:
        return [3, 1, 4, 0]

    new, cached = _step([("r", 0)], [])
    assert side.plan(new, cached, {"r": 64}, blocks).saves == []  # tokens 0..63 of 100
    new, cached = _step([], [("r", 64)])
    plan = side.plan(new, cached, {"r": 36}, blocks)
    assert [(s.transfer_id, s.block_ids, s.num_tokens) for s in plan.saves] == [
        (5, (3, 1, 4, 0), 100)
    ]
    assert side.plan(*_step([], [("r", 100)]), {"r": 1}, blocks).saves == []  # once only
    delay, params = side.finished(request)
    assert delay and params == {"topkv": {"transfer_id": 5, "kv_bytes": 100 * PER_TOKEN}}


def test_a_load_covers_what_is_not_cached_here_and_reports_a_failure(
    settings: ConnectorSettings,
) -> None:
    side = SchedulerSide(settings, block_size=32, bytes_per_token=PER_TOKEN)
    load = {"do_remote_prefill": True, "topkv": {"transfer_id": 9, "medium": "shm"}}
    request = _request("d", 100, load)
    assert side.num_new_matched_tokens(request, 32) == (68, True)  # one block cached here
    side.after_alloc(request, [7, 8, 9, 10], 68)
    assert request.kv_transfer_params["do_remote_prefill"] is False  # loaded once
    plan = side.plan(*_step([], []), {}, lambda _r: [])
    [spec] = plan.loads
    assert (spec.start, spec.num_tokens, spec.block_ids, spec.medium) == (
        32,
        100,
        (7, 8, 9, 10),
        "shm",
    )
    side.loaded({"d"}, invalid_block_ids={9})
    assert side.finished(request) == (
        False,
        {"topkv": {"transfer_id": 9, "medium": "shm", "kv_bytes": 0, "verified": False,
                   "recomputed": True}},
    )  # fmt: skip


def test_bad_parameters_are_named(settings: ConnectorSettings, tmp_path: Path) -> None:
    side = SchedulerSide(settings, block_size=32, bytes_per_token=PER_TOKEN)
    load, send = "do_remote_prefill", "do_remote_decode"
    bad = [
        ({load: True, "topkv": {"transfer_id": -1, "medium": "shm"}}, "transfer_id"),
        ({load: True, "topkv": {"transfer_id": 1, "medium": "rdma"}}, "medium"),
        ({send: True, "topkv": {"transfer_id": 1, "destination": "x"}}, "destination"),
        ({send: True, "topkv": {"transfer_id": 1, "destination": "tcp://h:1", "fault": 1}}, "fa"),
    ]  # fmt: skip
    for params, field in bad:
        with pytest.raises(ConnectorConfigError, match=field):
            side.after_alloc(_request("x", 10, params), [0], 10)
    assert side.num_new_matched_tokens(_request("y", 10, {"do_remote_prefill": True}), 0) == (
        0,
        False,
    )
    with pytest.raises(ConnectorConfigError, match="secret"):
        ConnectorSettings.from_extra({}, "kv_consumer")
    (tmp_path / "short").write_text("short")
    with pytest.raises(ConnectorConfigError, match=">= 16 bytes"):
        ConnectorSettings.from_extra({"secret_file": str(tmp_path / "short")}, "kv_consumer")


def test_a_report_request_gets_the_loads_report_and_a_bad_one_an_error(
    settings: ConnectorSettings,
) -> None:
    """What the front door asks for a streamed answer: the load's report, once it finished
    (while its request still runs, and after it finished)."""
    side = SchedulerSide(settings, block_size=32, bytes_per_token=PER_TOKEN)
    load = {"do_remote_prefill": True, "topkv": {"transfer_id": 11, "medium": "tcp"}}
    request = _request("d", 64, load)
    side.after_alloc(request, [1, 2], side.num_new_matched_tokens(request, 0)[0])

    def ask(transfer_id: object) -> dict[str, object] | None:
        query = _request("q", 1, {"topkv": {"report_of": transfer_id}})
        assert side.num_new_matched_tokens(query, 0) == (0, False)  # it loads nothing
        delay, params = side.finished(query)
        assert not delay and params is not None
        return params["topkv"]  # type: ignore[no-any-return]

    assert ask(11) == {"report_of": 11, "report": None}  # not loaded yet
    side.loaded({"d"}, invalid_block_ids=set())
    report = {"transfer_id": 11, "medium": "tcp", "kv_bytes": 64 * PER_TOKEN,
              "verified": True, "recomputed": False}  # fmt: skip
    assert ask(11) == {"report_of": 11, "report": report}  # the request still decodes
    assert side.finished(request) == (False, {"topkv": report})
    assert ask(11) == {"report_of": 11, "report": report}  # kept after it finished
    assert ask(12) == {"report_of": 12, "report": None}
    bad = ask(-3)
    assert bad is not None and "report_of must be an int >= 0" in str(bad["error"])


def test_a_skipped_prefix_is_not_streamed(settings: ConnectorSettings) -> None:
    """``skip_tokens``: the destination holds them; the last prompt token always travels."""
    side = SchedulerSide(settings, block_size=32, bytes_per_token=PER_TOKEN)
    for skip, first in ((64, 64), (500, 99)):
        part = {"transfer_id": skip, "destination": "tcp://h:1", "skip_tokens": skip}
        params = {"do_remote_decode": True, "topkv": part}
        request = _request(f"r{skip}", 100, params)
        side.after_alloc(request, [0, 1, 2, 3], 0)
        [save] = side.plan(*_step([(f"r{skip}", 0)], []), {f"r{skip}": 100}, lambda _r: [0]).saves
        assert (save.first_token, save.num_tokens) == (first, 100)
        assert side.finished(request)[1] == {
            "topkv": {"transfer_id": skip, "kv_bytes": (100 - first) * PER_TOKEN}
        }
    bad = {"do_remote_decode": True,
           "topkv": {"transfer_id": 1, "destination": "tcp://h:1", "skip_tokens": -1}}  # fmt: skip
    with pytest.raises(ConnectorConfigError, match="skip_tokens"):
        side.after_alloc(_request("x", 10, bad), [0], 0)
