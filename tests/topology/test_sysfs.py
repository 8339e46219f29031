"""sysfs readers: fake trees under tmp_path (IB, PCI, NUMA) and the real machine's /sys."""

from __future__ import annotations

from pathlib import Path

import pytest

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.numa import NumaNodeInfo, parse_cpu_list
from topkv.topology.detect.rdma import RdmaPort
from topkv.topology.sysfs import (
    SysfsPciDevice,
    read_infiniband,
    read_numa_nodes,
    read_pci_devices,
    read_pci_numa,
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def make_ib_port(
    root: Path, dev: str, port: int, state: str, phys: str, rate: str, layer: str
) -> None:
    base = root / "sys/class/infiniband" / dev / "ports" / str(port)
    write(base / "state", state)
    write(base / "phys_state", phys)
    write(base / "rate", rate)
    write(base / "link_layer", layer)
    write(base / "lid", "0x1a")


def test_read_infiniband_fake_tree(tmp_path: Path) -> None:
    make_ib_port(
        tmp_path, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand"
    )
    dev0 = tmp_path / "sys/class/infiniband/mlx5_0"
    write(dev0 / "node_guid", "a088:c203:0055:8e4a")
    write(dev0 / "fw_ver", "28.39.2048")
    write(dev0 / "hca_type", "MT4129")
    write(dev0 / "device/net/ibp26s0/dev_port", "0")
    # A two-port mlx4-style function: netdevs matched to ports by dev_port.
    make_ib_port(tmp_path, "mlx4_0", 1, "1: DOWN", "3: Disabled", "10 Gb/sec (4X)", "Ethernet")
    make_ib_port(tmp_path, "mlx4_0", 2, "4: ACTIVE", "5: LinkUp", "40 Gb/sec (4X QDR)", "Ethernet")
    write(tmp_path / "sys/class/infiniband/mlx4_0/device/net/eth3/dev_port", "1")
    write(tmp_path / "sys/class/infiniband/mlx4_0/device/net/eth2/dev_port", "0")

    ports = read_infiniband(tmp_path)
    assert ports == [
        RdmaPort("mlx4_0", 1, "DOWN", "Disabled", "Ethernet", 10.0, "eth2", lid=26),
        RdmaPort("mlx4_0", 2, "ACTIVE", "LinkUp", "Ethernet", 40.0, "eth3", lid=26),
        RdmaPort(
            "mlx5_0",
            1,
            "ACTIVE",
            "LinkUp",
            "InfiniBand",
            400.0,
            "ibp26s0",
            node_guid="0xa088c20300558e4a",
            lid=26,
            fw_version="28.39.2048",
            ca_type="MT4129",
        ),
    ]


def test_read_infiniband_natural_device_order(tmp_path: Path) -> None:
    for i in (0, 1, 10, 2):
        make_ib_port(tmp_path, f"mlx5_{i}", 1, "4: ACTIVE", "5: LinkUp", "200", "InfiniBand")
    assert [p.device for p in read_infiniband(tmp_path)] == [
        "mlx5_0",
        "mlx5_1",
        "mlx5_2",
        "mlx5_10",
    ]


def make_pci(root: Path, bdf: str, vendor: str, device: str, cls: str, numa: str) -> None:
    base = root / "sys/bus/pci/devices" / bdf
    write(base / "vendor", vendor)
    write(base / "device", device)
    write(base / "class", cls)
    write(base / "numa_node", numa)


def test_read_pci_devices_tells_gpus_and_nics_apart(tmp_path: Path) -> None:
    make_pci(tmp_path, "0000:18:00.0", "0x10de", "0x2330", "0x030200", "0")  # H100
    make_pci(tmp_path, "0000:17:00.0", "0x15b3", "0x1021", "0x020700", "0")  # CX-7 IB
    make_pci(tmp_path, "0000:9a:00.0", "0x1002", "0x74a1", "0x120000", "1")  # MI300X
    make_pci(tmp_path, "0000:c1:00.0", "0x15b3", "0x101f", "0x020000", "-1")  # CX-6 Lx Eth
    make_pci(tmp_path, "0000:00:02.0", "0x1a03", "0x2000", "0x030000", "-1")  # BMC VGA
    devices = read_pci_devices(tmp_path)
    assert [d.bdf for d in devices] == [
        "0000:00:02.0",
        "0000:17:00.0",
        "0000:18:00.0",
        "0000:9a:00.0",
        "0000:c1:00.0",
    ]
    assert devices[2] == SysfsPciDevice("0000:18:00.0", 0x10DE, 0x2330, 0x030200, 0)
    assert [d.bdf for d in devices if d.is_gpu] == ["0000:18:00.0", "0000:9a:00.0"]
    assert [d.bdf for d in devices if d.is_nic] == ["0000:17:00.0", "0000:c1:00.0"]
    assert devices[4].numa_node is None
    assert read_pci_numa(tmp_path) == {"0000:17:00.0": 0, "0000:18:00.0": 0, "0000:9a:00.0": 1}


def test_read_pci_bad_class_file(tmp_path: Path) -> None:
    make_pci(tmp_path, "0000:18:00.0", "0x10de", "0x2330", "garbage", "0")
    with pytest.raises(ParseError, match="class"):
        read_pci_devices(tmp_path)


def test_read_numa_nodes_with_cpuless_node(tmp_path: Path) -> None:
    base = tmp_path / "sys/devices/system/node"
    write(base / "node0/cpulist", "0-71")
    write(
        base / "node0/meminfo",
        "Node 0 MemTotal:       491520000 kB\nNode 0 MemFree:        480000000 kB\n"
        "Node 0 MemUsed:        11520000 kB",
    )
    write(base / "node0/distance", "10 80")
    write(base / "node1/cpulist", "")
    write(base / "node1/meminfo", "Node 1 MemTotal:       100663296 kB\nNode 1 MemFree: 0 kB")
    write(base / "node1/distance", "80 10")
    write(base / "online", "0-1")
    nodes = read_numa_nodes(tmp_path)
    assert nodes == [
        NumaNodeInfo(0, tuple(range(72)), 480000, 468750, (10, 80)),
        NumaNodeInfo(1, (), 98304, 0, (80, 10)),
    ]
    assert nodes[1].cpuless


def test_read_numa_bad_cpulist(tmp_path: Path) -> None:
    write(tmp_path / "sys/devices/system/node/node0/cpulist", "zero")
    with pytest.raises(ParseError, match="cpulist"):
        read_numa_nodes(tmp_path)


def test_missing_trees_mean_nothing_found(tmp_path: Path) -> None:
    assert read_infiniband(tmp_path) == []
    assert read_pci_devices(tmp_path) == []
    assert read_pci_numa(tmp_path) == {}
    assert read_numa_nodes(tmp_path) == []


@pytest.mark.skipif(not Path("/sys/devices/system/node").is_dir(), reason="no NUMA sysfs")
def test_real_machine_sysfs() -> None:
    nodes = read_numa_nodes()
    assert nodes, "Linux with NUMA sysfs has at least node0"
    all_cpus = {cpu for node in nodes for cpu in node.cpus}
    online = parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text())
    assert set(online) <= all_cpus  # every online CPU belongs to a NUMA node
    assert sum(len(n.cpus) for n in nodes) == len(all_cpus)  # ...and to only one
    assert all(n.memory_mb is None or n.memory_mb > 0 for n in nodes if not n.cpuless)
    assert all(n.distances is None or len(n.distances) == len(nodes) for n in nodes)
    devices = read_pci_devices()
    assert all(d.bdf.count(":") == 2 and 0 <= d.vendor <= 0xFFFF for d in devices)
    assert set(read_pci_numa()) <= {d.bdf for d in devices}
    ib_root = Path("/sys/class/infiniband")
    ports = read_infiniband()
    assert len({p.device for p in ports}) == (
        len(list(ib_root.iterdir())) if ib_root.is_dir() else 0
    )
    assert all(p.state is None or p.state.isupper() for p in ports)
