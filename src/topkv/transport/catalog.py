"""Which transports exist here, and how to make a source/sink pair for each.

Names: ``shm``, ``tcp`` (real media) and ``emulated-<mode>`` (a paced wrapper over a real
medium for nvlink, nvswitch, pcie, rdma, tcp). Backends living in other modules (nixl,
mooncake, cuda) register themselves with :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from topkv.transport.base import TransferSink, TransferSource, TransportMode
from topkv.transport.emulated import EmulatedSource, LinkModel
from topkv.transport.errors import TransportUnavailable
from topkv.transport.media import real_medium
from topkv.transport.shm import ShmSink, ShmSource
from topkv.transport.tcp import TcpSink, TcpSource


@dataclass(frozen=True)
class TransportInfo:
    name: str
    mode: TransportMode
    emulated: bool
    make_source: Callable[[bytes], TransferSource]
    make_sink: Callable[[bytes], TransferSink]
    description: str


_CATALOG: dict[str, TransportInfo] = {}


def register(info: TransportInfo) -> None:
    _CATALOG[info.name] = info


def _emulated(mode: TransportMode, dilation: float = 1.0) -> TransportInfo:
    use_shm = real_medium(mode.value) == "shm"  # same-host classes ride on shm; the rest on tcp
    inner_source: Callable[[bytes], TransferSource] = ShmSource if use_shm else TcpSource
    inner_sink: Callable[[bytes], TransferSink] = ShmSink if use_shm else TcpSink
    link = LinkModel.default(mode)
    return TransportInfo(
        name=f"emulated-{mode.value}",
        mode=mode,
        emulated=True,
        make_source=lambda secret: EmulatedSource(inner_source(secret), link, dilation=dilation),
        make_sink=inner_sink,
        description=f"{mode.value} paced to {link.bandwidth_gbps} GB/s over "
        f"{'shm' if use_shm else 'tcp'} (emulated)",
    )


register(
    TransportInfo("shm", TransportMode.PCIE, False, ShmSource, ShmSink, "same-host shared memory")
)
register(TransportInfo("tcp", TransportMode.TCP, False, TcpSource, TcpSink, "TCP sockets"))
for _mode in TransportMode:
    register(_emulated(_mode))


def available() -> dict[str, TransportInfo]:
    return dict(_CATALOG)


def get(name: str) -> TransportInfo:
    try:
        return _CATALOG[name]
    except KeyError:
        raise TransportUnavailable(
            f"unknown transport {name!r}; available: {', '.join(sorted(_CATALOG))}"
        ) from None


def emulated(mode: TransportMode | str, dilation: float) -> TransportInfo:
    """An emulated transport for ``mode`` with an explicit time-dilation factor."""
    return _emulated(TransportMode(mode), dilation)
