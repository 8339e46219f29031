"""RDMA tool parsers: every fixture under tests/fixtures/rdma, pasted variants, fuzzing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fuzzing import fuzz_arbitrary_text, fuzz_mutated_fixtures
from hypothesis import strategies as st

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.rdma import (
    RdmaPort,
    merge_ports,
    normalize_phys_state,
    normalize_state,
    parse_ibdev2netdev,
    parse_ibstat,
    parse_ibstatus,
    parse_ibv_devinfo,
    parse_rate_gbps,
    parse_rdma_link,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rdma"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --------------------------------------------------------------------------- fixtures


def test_ibstat_mlx4_connectx3_fdr() -> None:
    (port,) = parse_ibstat(fixture("mlx4-connectx3-fdr-ibstat.txt"))
    assert port == RdmaPort(
        device="mlx4_0",
        port=1,
        state="ACTIVE",
        phys_state="LinkUp",
        link_layer="InfiniBand",
        rate_gbps=56.0,
        netdev=None,
        node_guid="0x98039b0300dccab0",
        lid=1,
        fw_version="2.42.5000",
        ca_type="MT4099",
    )


def test_ibstat_cx6_hdr_partial_one_active_one_down() -> None:
    ports = parse_ibstat(fixture("nccl-tests-128-cx6-hdr-ib-ibstat-partial.txt"))
    assert [(p.device, p.port) for p in ports] == [("mlx5_0", 1), ("mlx5_1", 1)]
    up, down = ports
    assert (up.state, up.phys_state, up.rate_gbps, up.lid) == ("ACTIVE", "LinkUp", 200.0, 569)
    assert (down.state, down.phys_state, down.rate_gbps) == ("DOWN", "Disabled", 10.0)
    assert {p.link_layer for p in ports} == {"InfiniBand"}
    assert {p.ca_type for p in ports} == {"MT4123"}
    assert {p.fw_version for p in ports} == {"20.33.1048"}
    assert down.node_guid == "0x1070fd03008ea7a4"


def test_ibstat_roce_ports_down_without_guid_lines() -> None:
    ports = parse_ibstat(fixture("arthurchiao-h20-server-cx6lx-ibstat-roce-down.txt"))
    assert [p.device for p in ports] == ["mlx5_0", "mlx5_1"]
    for p in ports:
        assert (p.state, p.phys_state, p.link_layer) == ("DOWN", "Disabled", "Ethernet")
        assert (p.rate_gbps, p.ca_type, p.node_guid, p.fw_version) == (40.0, "MT4127", None, None)


def test_ibv_devinfo_cx7_port_down_space_separated() -> None:
    (port,) = parse_ibv_devinfo(fixture("deepep-38-h100-ibv_devinfo-mlx5_0-cx7-ib-down.txt"))
    assert (port.device, port.port, port.state) == ("mlx5_0", 1, "DOWN")
    assert (port.link_layer, port.lid, port.fw_version) == ("InfiniBand", 65535, "28.39.2048")
    assert port.node_guid == "0x58a2e103002a09b8"
    assert port.ca_type == "MT4129"
    assert port.rate_gbps is None  # plain ibv_devinfo does not print width/speed


def test_ibstatus_roce_100g() -> None:
    ports = parse_ibstatus(fixture("nccl-1866-roce-100g-ibstatus-partial.txt"))
    assert [(p.device, p.port) for p in ports] == [("mlx5_0", 1), ("mlx5_1", 1)]
    for p in ports:
        assert (p.state, p.phys_state, p.link_layer, p.rate_gbps) == (
            "ACTIVE",
            "LinkUp",
            "Ethernet",
            100.0,
        )
        assert p.lid == 0


def test_ibdev2netdev_annotated_column_aligned() -> None:
    ports = parse_ibdev2netdev(fixture("imbue-cluster-health-4-h100-ibdev2netdev-annotated.txt"))
    assert len(ports) == 12
    by_dev = {p.device: p for p in ports}
    assert by_dev["mlx5_0"].netdev == "ibp26s0"
    assert by_dev["mlx5_10"].netdev == "ibp204s0"
    assert by_dev["mlx5_7"].netdev == "enp157s0f0np0"
    assert sorted(d for d, p in by_dev.items() if p.state == "ACTIVE") == ["mlx5_1", "mlx5_7"]
    assert sum(p.state == "DOWN" for p in ports) == 10
    assert sum(p.netdev is not None and p.netdev.startswith("ib") for p in ports) == 8
    assert all(p.port == 1 and p.link_layer is None for p in ports)


@pytest.mark.parametrize(
    ("name", "devices", "netdevs"),
    [
        (
            "amd-instinct-broadcom-bnxt-re-8nic-rdma-link.txt",
            [f"bnxt_re{i}" for i in range(8)],
            [f"ens{n}np0" for n in (26, 27, 25, 24, 22, 23, 21, 20)],
        ),
        (
            "amd-instinct-pensando-ionic-8nic-rdma-link.txt",
            [f"ionic_{i}" for i in range(8)],
            [f"benic{i}p1" for i in (7, 8, 6, 5, 3, 2, 1, 4)],
        ),
    ],
)
def test_rdma_link_non_mellanox(name: str, devices: list[str], netdevs: list[str]) -> None:
    ports = parse_rdma_link(fixture(name))
    assert [p.device for p in ports] == devices
    assert [p.netdev for p in ports] == netdevs
    assert {(p.port, p.state, p.phys_state) for p in ports} == {(1, "ACTIVE", "LinkUp")}


def test_every_rdma_fixture_is_covered() -> None:
    parsers = {
        "ibstat(?!us)": parse_ibstat,
        "ibv_devinfo": parse_ibv_devinfo,
        "ibstatus": parse_ibstatus,
        "ibdev2netdev": parse_ibdev2netdev,
        "rdma-link": parse_rdma_link,
    }
    for path in sorted(FIXTURES.iterdir()):
        matching = [p for key, p in parsers.items() if re.search(key, path.name)]
        assert len(matching) == 1, path.name
        assert matching[0](path.read_text()), path.name


# --------------------------------------------------------------------------- variants


def test_ibv_devinfo_verbose_rate_and_phys_state() -> None:
    text = (
        "hca_id:\tmlx5_3\n\ttransport:\t\t\tInfiniBand (0)\n\tfw_ver:\t\t\t\t28.41.1000\n"
        "\tvendor_id:\t\t\t0x02c9\n\tvendor_part_id:\t\t\t4129\n\tphys_port_cnt:\t\t\t1\n"
        "\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tport_lid:\t\t12\n"
        "\t\t\tlink_layer:\t\tInfiniBand\n\t\t\tactive_width:\t\t4X (2)\n"
        "\t\t\tactive_speed:\t\t100.0 Gbps (128)\n\t\t\tphys_state:\t\tLINK_UP (5)\n"
        "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:a088:c203:0055:8e4a\n"
    )
    (port,) = parse_ibv_devinfo(text)
    assert (port.state, port.phys_state, port.rate_gbps, port.lid) == (
        "ACTIVE",
        "LinkUp",
        400.0,
        12,
    )


def test_ibstat_with_ansi_crlf_prompt_and_fence() -> None:
    text = (
        "$ ibstat\r\n```\r\nCA 'mlx5_2'\r\n\tCA type: MT4129\r\n\tPort 1:\r\n"
        "\t\tState: \x1b[32mActive\x1b[0m   \r\n\t\tPhysical state: LinkUp\r\n"
        "\t\tRate: 400\r\n\t\tLink layer: InfiniBand\r\n```\r\n"
    )
    (port,) = parse_ibstat(text)
    assert (port.device, port.state, port.rate_gbps) == ("mlx5_2", "ACTIVE", 400.0)


def test_ibdev2netdev_verbose() -> None:
    text = (
        "0000:05:00.0 mlx5_0 (MT4123 - MCX653105A-HDAT) ConnectX-6 VPI adapter card, "
        "HDR IB (200Gb/s) fw 20.31.1014 port 1 (ACTIVE) ==> ib0 (Up)\n"
        "0000:06:00.0 mlx5_1 (MT4123 - MCX653105A-HDAT) fw 20.31.1014 port 1 (DOWN ) "
        "==> ib1 (Down)\n"
    )
    ports = parse_ibdev2netdev(text)
    assert [(p.device, p.state, p.netdev, p.ca_type, p.fw_version) for p in ports] == [
        ("mlx5_0", "ACTIVE", "ib0", "MT4123", "20.31.1014"),
        ("mlx5_1", "DOWN", "ib1", "MT4123", "20.31.1014"),
    ]


def test_rdma_link_old_format_ib_fields_and_json() -> None:
    text = (
        "0/1: mlx5_0/1: state ACTIVE physical_state LINK_UP netdev ens785f0\n"
        "link mlx5_1/1 subnet_prefix fe80:0000:0000:0000 lid 12 sm_lid 1 lmc 0 "
        "state DOWN physical_state POLLING\n"
    )
    a, b = parse_rdma_link(text)
    assert (a.device, a.state, a.phys_state, a.netdev) == ("mlx5_0", "ACTIVE", "LinkUp", "ens785f0")
    assert (b.device, b.lid, b.state, b.phys_state, b.netdev) == (
        "mlx5_1",
        12,
        "DOWN",
        "Polling",
        None,
    )
    js = (
        '[{"ifindex":0,"ifname":"mlx5_0","port":1,"state":"ACTIVE",'
        '"physical_state":"LINK_UP","netdev":"ens1np0","netdev_index":3}]'
    )
    (c,) = parse_rdma_link(js)
    assert (c.device, c.port, c.state, c.phys_state, c.netdev) == (
        "mlx5_0",
        1,
        "ACTIVE",
        "LinkUp",
        "ens1np0",
    )


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("Active", "ACTIVE"),
        ("ACTIVE", "ACTIVE"),
        ("4: ACTIVE", "ACTIVE"),
        ("PORT_ACTIVE (4)", "ACTIVE"),
        ("1: DOWN", "DOWN"),
        ("Initializing", "INIT"),
        ("PORT_ARMED (3)", "ARMED"),
        ("4", "ACTIVE"),
    ],
)
def test_state_normalisation(raw: str, state: str) -> None:
    assert normalize_state(raw) == state


@pytest.mark.parametrize(
    ("raw", "phys"),
    [
        ("LinkUp", "LinkUp"),
        ("5: LinkUp", "LinkUp"),
        ("LINK_UP", "LinkUp"),
        ("LINK_UP (5)", "LinkUp"),
        ("3: Disabled", "Disabled"),
        ("POLLING", "Polling"),
        ("6: LinkErrorRecovery", "LinkErrorRecovery"),
    ],
)
def test_phys_state_normalisation(raw: str, phys: str) -> None:
    assert normalize_phys_state(raw) == phys


@pytest.mark.parametrize(
    ("raw", "gbps"),
    [
        ("400", 400.0),
        ("400 Gb/sec (4X NDR)", 400.0),
        ("100Gbps", 100.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("200 Gb/s", 200.0),
        ("25000 Mb/s", 25.0),
        ("N/A", None),
    ],
)
def test_rate_parsing(raw: str, gbps: float | None) -> None:
    assert parse_rate_gbps(raw) == gbps


def test_merge_combines_tools_first_source_wins() -> None:
    ibstat = parse_ibstat(fixture("nccl-tests-128-cx6-hdr-ib-ibstat-partial.txt"))
    netdevs = parse_ibdev2netdev("mlx5_0 port 1 ==> ib0 (Up)\nmlx5_1 port 1 ==> ib1 (Up)\n")
    merged = merge_ports(ibstat, netdevs)
    assert [(p.device, p.netdev, p.rate_gbps) for p in merged] == [
        ("mlx5_0", "ib0", 200.0),
        ("mlx5_1", "ib1", 10.0),
    ]
    # ibstat came first, so its DOWN wins over ibdev2netdev's netdev "(Up)".
    assert merged[1].state == "DOWN"
    assert merge_ports(netdevs, ibstat)[1].state == "ACTIVE"
    assert merge_ports() == []


# --------------------------------------------------------------------------- errors

PARSERS = [parse_ibstat, parse_ibv_devinfo, parse_ibstatus, parse_ibdev2netdev, parse_rdma_link]


@pytest.mark.parametrize("parser", PARSERS)
def test_empty_and_no_devices_give_empty_list(parser: object) -> None:
    assert callable(parser)
    assert parser("") == []
    assert parser("  \n\t\n") == []
    assert parser("No IB devices found\n") == []


@pytest.mark.parametrize("parser", PARSERS)
def test_other_text_raises_parse_error_naming_the_tool(parser: object) -> None:
    assert callable(parser)
    with pytest.raises(ParseError, match=r"ibstat|ibv_devinfo|ibstatus|ibdev2netdev|rdma link"):
        parser("GPU0\tX\tNV18\nthis is not RDMA output\n")


def test_wrong_tool_output_is_rejected() -> None:
    with pytest.raises(ParseError, match="ibv_devinfo"):
        parse_ibv_devinfo(fixture("amd-instinct-broadcom-bnxt-re-8nic-rdma-link.txt"))
    with pytest.raises(ParseError, match="ibstatus"):
        parse_ibstatus(fixture("mlx4-connectx3-fdr-ibstat.txt"))


# --------------------------------------------------------------------------- fuzzing

ALL_TEXTS = [p.read_text() for p in sorted(FIXTURES.iterdir())]
ALPHABET = st.sampled_from(list("abcdeflmnprstxACDILNPRSTX0123456789 \t\n:=/'\"()#-_.,>[]{}\x1b"))


def _only_parse_errors(text: str) -> None:
    for parser in PARSERS:
        try:
            result = parser(text)
        except ParseError:
            continue
        assert all(isinstance(p, RdmaPort) for p in result)


@fuzz_arbitrary_text(ALPHABET)
def test_fuzz_arbitrary_text(text: str) -> None:
    _only_parse_errors(text)


@fuzz_mutated_fixtures(ALL_TEXTS, ALPHABET)
def test_fuzz_mutated_fixtures(text: str) -> None:
    _only_parse_errors(text)
