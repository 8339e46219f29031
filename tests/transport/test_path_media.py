"""The one decision from a pair's path class to its medium (topkv.transport.media), alone."""

from __future__ import annotations

from collections.abc import Callable, Collection

from topkv.transport.media import (
    ARENA_MEDIA_FOR_PATH,
    MediumChoice,
    candidate_media,
    medium_for,
)

CONNECTOR_MEDIA = ("shm", "tcp", "nixl", "mooncake")


def _judge(accepted: Collection[str], asked: list[str]) -> Callable[[str], str | None]:
    """A check that accepts ``accepted`` and records every medium it was asked about."""

    def check(medium: str) -> str | None:
        asked.append(medium)
        return None if medium in accepted else f"{medium} refused"

    return check


def test_an_arena_medium_serving_the_class_comes_before_the_class_own() -> None:
    assert ARENA_MEDIA_FOR_PATH["rdma"] == ("nixl",)
    asked: list[str] = []
    choice = medium_for("rdma", None, False, _judge({"nixl", "tcp"}, asked), own=("tcp",))
    assert choice == MediumChoice("nixl") and asked == ["nixl"]

    asked.clear()
    choice = medium_for("rdma", None, False, _judge({"tcp"}, asked), own=("emulated-rdma",))
    assert choice.medium is None and asked == ["nixl", "emulated-rdma"]
    assert choice.refused == (("nixl", "nixl refused"), ("emulated-rdma", "emulated-rdma refused"))
    assert choice.why_refused("emulated-rdma") == "emulated-rdma refused"
    assert choice.why_refused("tcp") is None


def test_the_first_accepted_candidate_wins_and_the_refused_ones_are_kept_in_order() -> None:
    asked: list[str] = []
    choice = medium_for(
        "nvlink", None, True, _judge({"tcp"}, asked), own=("emulated-nvlink", "tcp", "shm")
    )
    assert choice.medium == "tcp" and asked == ["cuda", "emulated-nvlink", "tcp"]
    assert [medium for medium, _ in choice.refused] == ["cuda", "emulated-nvlink"]


def test_a_forced_medium_is_the_only_candidate_whatever_the_class() -> None:
    asked: list[str] = []
    check = _judge({"nixl", "mooncake"}, asked)
    assert medium_for("pcie", None, True, check, own=("shm",), forced="mooncake").medium == (
        "mooncake"
    )
    assert asked == ["mooncake"]
    refused = medium_for("rdma", None, True, check, own=("tcp",), forced="shm")
    assert refused == MediumChoice(None, (("shm", "shm refused"),))


def test_offers_keep_only_the_caller_media_and_no_same_host_medium_across_hosts() -> None:
    own = ("shm", "tcp")
    assert candidate_media("pcie", CONNECTOR_MEDIA, True, own=own) == ["shm", "tcp"]
    assert candidate_media("pcie", CONNECTOR_MEDIA, False, own=own) == ["tcp"]
    # cuda serves nvlink but is not among these offers
    assert candidate_media("nvlink", CONNECTOR_MEDIA, True, own=own) == ["shm", "tcp"]
    # without offers every medium stays, for the caller's check to judge
    assert candidate_media("nvlink", None, False, own=own) == ["cuda", "shm", "tcp"]


def test_allowed_keeps_the_policy_order_first_then_the_other_allowed_media() -> None:
    own = ("tcp",)
    assert candidate_media("rdma", CONNECTOR_MEDIA, False, own=own, allowed=["tcp"]) == ["tcp"]
    assert candidate_media(
        "rdma", CONNECTOR_MEDIA, False, own=own, allowed=["shm", "tcp", "nixl"]
    ) == ["nixl", "tcp", "shm"]
    assert candidate_media("pcie", CONNECTOR_MEDIA, True, own=("shm", "tcp"), allowed=[]) == []


def test_a_medium_named_twice_is_tried_once() -> None:
    asked: list[str] = []
    choice = medium_for("rdma", None, False, _judge((), asked), own=("nixl", "tcp", "nixl"))
    assert choice.medium is None and asked == ["nixl", "tcp"]
