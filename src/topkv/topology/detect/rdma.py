"""Parsers for RDMA tool output: ``ibstat``, ``ibv_devinfo``, ``ibstatus``, ``ibdev2netdev``
and ``rdma link``.

Every parser is pure (text in, :class:`RdmaPort` records out) and tolerant of what people
paste: tabs or spaces, ANSI escapes, CRLF, trailing whitespace, prompt lines, Markdown fences,
``# comments`` and truncated output. Values are normalised so records from different tools
can be merged with :func:`merge_ports`:

- ``state``: ``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED``, ``ACTIVE_DEFER`` (from ``Active``,
  ``4: ACTIVE``, ``PORT_ACTIVE (4)``, ...).
- ``phys_state``: ``LinkUp``, ``Disabled``, ``Polling``, ``Sleep``, ``LinkErrorRecovery``,
  ``PortConfigurationTraining``, ``PhyTest`` (from ``5: LinkUp``, ``LINK_UP``, ...).
- ``link_layer``: ``InfiniBand`` or ``Ethernet`` (RoCE); anything else becomes ``None``.
- ``rate_gbps``: Gb/s as a float (``Rate: 400``, ``400 Gb/sec (4X NDR)``, ``100Gbps``).
- ``node_guid``: ``0x`` + 16 lowercase hex digits (``58a2:e103:002a:09b8`` is rewritten).

Empty input (or the tools' own "no devices" message) yields ``[]``; non-empty input in which
no device record can be found raises :class:`ParseError`.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from topkv.topology.detect.errors import ParseError


@dataclass(frozen=True)
class RdmaPort:
    """One port of one RDMA device, as far as the tool that produced it tells."""

    device: str
    port: int
    state: str | None
    phys_state: str | None
    link_layer: str | None  # "InfiniBand" | "Ethernet"
    rate_gbps: float | None
    netdev: str | None
    node_guid: str | None = None
    lid: int | None = None
    fw_version: str | None = None
    ca_type: str | None = None


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]")
_NO_DEVICES = re.compile(r"no (?:ib|rdma|infiniband)? ?devices? (?:were )?found", re.IGNORECASE)
_MAX_PORT = 1 << 16


def clean_lines(text: str) -> list[str]:
    """Split tool output into lines without ANSI escapes, carriage returns or trailing blanks."""
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    return [line.rstrip() for line in text.split("\n")]


# --------------------------------------------------------------------------- normalisers

_STATE_BY_NUMBER = {"0": "NOP", "1": "DOWN", "2": "INIT", "3": "ARMED", "4": "ACTIVE"}
_STATE_BY_NUMBER["5"] = "ACTIVE_DEFER"
_STATE_ALIASES = {"INITIALIZING": "INIT", "INITIALIZE": "INIT", "INITIALISED": "INIT"}
_PHYS_NAMES = {
    "SLEEP": "Sleep",
    "POLLING": "Polling",
    "DISABLED": "Disabled",
    "PORTCONFIGURATIONTRAINING": "PortConfigurationTraining",
    "LINKUP": "LinkUp",
    "LINKERRORRECOVERY": "LinkErrorRecovery",
    "PHYTEST": "PhyTest",
}
_PHYS_BY_NUMBER = dict(
    zip(
        "1234567",
        [
            "Sleep",
            "Polling",
            "Disabled",
            "PortConfigurationTraining",
            "LinkUp",
            "LinkErrorRecovery",
            "PhyTest",
        ],
        strict=True,
    )
)
_NUMBERED = re.compile(r"^\s*(\d+)\s*:\s*(.*)$")  # "4: ACTIVE"
_TRAILING_CODE = re.compile(r"^(.*?)\s*\((\d+)\)\s*$")  # "PORT_ACTIVE (4)"


def _split_code(value: str) -> tuple[str, str | None]:
    """Separate ``"4: ACTIVE"`` / ``"PORT_ACTIVE (4)"`` into the name and its number."""
    value = value.strip()
    m = _NUMBERED.match(value)
    if m:
        return m.group(2).strip(), m.group(1)
    m = _TRAILING_CODE.match(value)
    if m:
        return m.group(1).strip(), m.group(2)
    return value, None


def _normalize(
    value: str | None, by_number: Mapping[str, str], by_name: Callable[[str], str]
) -> str | None:
    """A port state given by name, number or both (``4: ACTIVE``): a number alone is looked
    up in ``by_number`` (an unknown one is kept as written), a name goes to ``by_name``."""
    if value is None:
        return None
    name, code = _split_code(value)
    if not name:
        return by_number.get(code or "")
    if name.isdigit():
        return by_number.get(name, name)
    return by_name(name)


def _state_name(name: str) -> str:
    key = re.sub(r"[\s-]+", "_", name.upper())
    key = key.removeprefix("PORT_") if key != "PORT_" else key
    return _STATE_ALIASES.get(key, key)


def _phys_state_name(name: str) -> str:
    return _PHYS_NAMES.get(re.sub(r"[\s_-]+", "", name.upper()), name)


def normalize_state(value: str | None) -> str | None:
    """Logical port state in upper case (``Active``, ``4: ACTIVE``, ``PORT_ACTIVE (4)``)."""
    return _normalize(value, _STATE_BY_NUMBER, _state_name)


def normalize_phys_state(value: str | None) -> str | None:
    """Physical port state in ibstat's spelling (``LinkUp``, ``Disabled``, ``Polling``...)."""
    return _normalize(value, _PHYS_BY_NUMBER, _phys_state_name)


def normalize_link_layer(value: str | None) -> str | None:
    """``InfiniBand`` or ``Ethernet``; unknown spellings give ``None``."""
    if value is None:
        return None
    key = re.sub(r"[\s_-]+", "", _split_code(value)[0].lower())
    if key in {"infiniband", "ib"}:
        return "InfiniBand"
    if key in {"ethernet", "eth", "roce", "rocev2", "iwarp"}:
        return "Ethernet"
    return None


_RATE = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])\s*(?:bits?|b)?\s*(?:/\s*s(?:ec)?|ps)?)?",
    re.IGNORECASE,
)
_RATE_SCALE = {"k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3, "": 1.0}


def parse_rate_gbps(value: str | None) -> float | None:
    """Gb/s from ``56``, ``400 Gb/sec (4X NDR)``, ``100Gbps``, ``25000 Mb/s``; else ``None``."""
    if value is None:
        return None
    m = _RATE.match(value)
    if not m:
        return None
    rate = float(m.group(1)) * _RATE_SCALE[(m.group(2) or "").lower()]
    return rate if math.isfinite(rate) else None


def normalize_guid(value: str | None) -> str | None:
    """``0x`` + 16 hex digits from ``0x98039b0300dccab0`` or ``58a2:e103:002a:09b8``."""
    if value is None:
        return None
    digits = value.strip().lower().removeprefix("0x").replace(":", "")
    if not digits or len(digits) > 16 or not re.fullmatch(r"[0-9a-f]+", digits):
        return None
    return "0x" + digits.rjust(16, "0")


def _parse_int(value: str | None) -> int | None:
    if value is None:
        return None
    token = value.strip().split(" ")[0] if value.strip() else ""
    try:
        return int(token, 0) if token.lower().startswith("0x") else int(token, 10)
    except ValueError:
        return None


def _port_number(value: str, tool: str) -> int:
    port = int(value)
    if port > _MAX_PORT:
        raise ParseError(f"{tool}: port number {value} is implausibly large")
    return port


def _only_no_devices(lines: list[str]) -> bool:
    """True when the text is empty or only the tool's "no devices found" message."""
    meaningful = [ln for ln in lines if ln.strip() and not ln.strip().startswith("```")]
    return not meaningful or all(_NO_DEVICES.search(ln) for ln in meaningful)


def _none_found(tool: str, lines: list[str]) -> list[RdmaPort]:
    if _only_no_devices(lines):
        return []
    raise ParseError(f"{tool}: no device/port records found in the input ({_what_it_was(lines)})")


def _what_it_was(lines: list[str]) -> str:
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    return f"first line: {first[:60]!r}"


# --------------------------------------------------------------------------- ibstat

_IBSTAT_CA = re.compile(
    r"^\s*CA\s+['\"`\u2018\u2019]([^'\"`\u2018\u2019]+)['\"`\u2018\u2019]\s*:?$"
)
_IBSTAT_PORT = re.compile(r"^\s*Port\s+(\d+)\s*:\s*$", re.IGNORECASE)
_FIELD = re.compile(r"^\s*([A-Za-z_][\w \[\]/-]*?)\s*:\s*(.*?)\s*$")


#: Makes one port's record: (device, port number, device fields, port fields) -> port.
_PortMaker = Callable[[str, int, dict[str, str], dict[str, str]], RdmaPort]


class _DeviceSections:
    """The device > port sections of ``ibstat`` and ``ibv_devinfo``.

    A field lands in the open port's fields, or in its device's before the device's first
    port (the first of repeated keys wins); each port becomes a record (``make``) when the
    next section starts or the text ends. Fields before the first device are dropped.
    """

    def __init__(self, make: _PortMaker) -> None:
        self.device: str | None = None
        self._make = make
        self._ports: list[RdmaPort] = []
        self._device_fields: dict[str, str] = {}
        self._port: int | None = None
        self._port_fields: dict[str, str] = {}

    def start_device(self, name: str) -> None:
        self._flush()
        self.device, self._device_fields, self._port, self._port_fields = name, {}, None, {}

    def start_port(self, number: int) -> None:
        self._flush()
        self._port, self._port_fields = number, {}

    def field(self, key: str, value: str) -> None:
        target = self._device_fields if self._port is None else self._port_fields
        target.setdefault(key, value)

    def finish(self, tool: str, lines: list[str]) -> list[RdmaPort]:
        """The ports found (raises :class:`ParseError` when text without devices had none)."""
        self._flush()
        return self._ports if self._ports else _none_found(tool, lines)

    def _flush(self) -> None:
        if self.device is not None and self._port is not None:
            port = self._make(self.device, self._port, self._device_fields, self._port_fields)
            self._ports.append(port)


def parse_ibstat(text: str) -> list[RdmaPort]:
    """Parse ``ibstat`` (all CAs or one). CAs cut before their ``Port N:`` section are dropped."""
    lines = clean_lines(text)
    found = _DeviceSections(_ibstat_port)
    for line in lines:
        if m := _IBSTAT_CA.match(line):
            found.start_device(m.group(1).strip())
        elif (m := _IBSTAT_PORT.match(line)) and found.device is not None:
            found.start_port(_port_number(m.group(1), "ibstat"))
        elif (m := _FIELD.match(line)) and found.device is not None:
            found.field(re.sub(r"\s+", " ", m.group(1).lower()), m.group(2))
    return found.finish("ibstat", lines)


@dataclass(frozen=True)
class _FieldNames:
    """One tool's names for the port fields (state .. lid) and device fields (node GUID,
    firmware) that an :class:`RdmaPort` reads."""

    state: str
    phys_state: str
    link_layer: str
    lid: str
    node_guid: str
    fw_version: str


_IBSTAT_NAMES = _FieldNames(
    "state", "physical state", "link layer", "base lid", "node guid", "firmware version"
)
_DEVINFO_NAMES = _FieldNames("state", "phys_state", "link_layer", "port_lid", "node_guid", "fw_ver")


def _tool_port(
    names: _FieldNames,
    where: tuple[str, int],
    device_fields: dict[str, str],
    fields: dict[str, str],
    rate_gbps: float | None,
    ca_type: str | None,
) -> RdmaPort:
    """A port from one tool's device and port sections, normalized the same way for all."""
    device, port = where
    return RdmaPort(
        device=device,
        port=port,
        state=normalize_state(fields.get(names.state)),
        phys_state=normalize_phys_state(fields.get(names.phys_state)),
        link_layer=normalize_link_layer(fields.get(names.link_layer)),
        rate_gbps=rate_gbps,
        netdev=None,
        node_guid=normalize_guid(device_fields.get(names.node_guid)),
        lid=_parse_int(fields.get(names.lid)),
        fw_version=device_fields.get(names.fw_version) or None,
        ca_type=ca_type,
    )


def _ibstat_port(device: str, port: int, ca: dict[str, str], fields: dict[str, str]) -> RdmaPort:
    rate = parse_rate_gbps(fields.get("rate"))
    return _tool_port(_IBSTAT_NAMES, (device, port), ca, fields, rate, ca.get("ca type") or None)


# --------------------------------------------------------------------------- ibv_devinfo

_WIDTH = re.compile(r"^\s*(\d+)\s*X\b", re.IGNORECASE)
_SPEED_NAMES = {
    "SDR": 2.5,
    "DDR": 5.0,
    "QDR": 10.0,
    "FDR10": 10.0,
    "FDR": 14.0,
    "EDR": 25.0,
    "HDR": 50.0,
    "NDR": 100.0,
    "XDR": 200.0,
}


def _lane_speed(value: str | None) -> float | None:
    if value is None:
        return None
    name = _split_code(value)[0].strip().upper()
    if name in _SPEED_NAMES:
        return _SPEED_NAMES[name]
    return parse_rate_gbps(value)


def _devinfo_rate(port_fields: dict[str, str]) -> float | None:
    """``active_width`` x ``active_speed`` (only present with ``ibv_devinfo -v``)."""
    width = _WIDTH.match(port_fields.get("active_width", ""))
    speed = _lane_speed(port_fields.get("active_speed"))
    if width is None or speed is None:
        return None
    return int(width.group(1)) * speed


def parse_ibv_devinfo(text: str) -> list[RdmaPort]:
    """Parse ``ibv_devinfo`` (plain or ``-v``); the rate is known only with ``-v``."""
    lines = clean_lines(text)
    found = _DeviceSections(_devinfo_port)
    for line in lines:
        m = _FIELD.match(line)
        if not m:
            continue
        key, value = m.group(1).strip().lower(), m.group(2)
        if key == "hca_id" and value:
            found.start_device(value.split()[0])
        elif found.device is None:
            continue
        elif key == "port" and value.isdigit():
            found.start_port(_port_number(value, "ibv_devinfo"))
        else:
            found.field(key, value)
    return found.finish("ibv_devinfo", lines)


def _devinfo_port(device: str, port: int, dev: dict[str, str], fields: dict[str, str]) -> RdmaPort:
    ca_type = None
    part = dev.get("vendor_part_id", "").strip()
    if part.isdigit() and dev.get("vendor_id", "").strip().lower() in {"0x02c9", "0x15b3"}:
        ca_type = f"MT{part}"  # Mellanox/NVIDIA: ibstat's "CA type" is MT<part id>
    return _tool_port(_DEVINFO_NAMES, (device, port), dev, fields, _devinfo_rate(fields), ca_type)


# --------------------------------------------------------------------------- ibstatus

_IBSTATUS_HEADER = re.compile(
    r"^\s*Infiniband\s+device\s+['\"`\u2018\u2019]?([^'\"`\u2018\u2019\s]+)['\"`\u2018\u2019]?"
    r"\s+port\s+(\d+)\s+status\s*:?\s*$",
    re.IGNORECASE,
)


def parse_ibstatus(text: str) -> list[RdmaPort]:
    """Parse ``ibstatus``: one ``Infiniband device 'X' port N status:`` block per port."""
    lines = clean_lines(text)
    ports: list[RdmaPort] = []
    current: tuple[str, int] | None = None
    port_fields: dict[str, str] = {}

    def flush() -> None:
        if current is None:
            return
        ports.append(
            RdmaPort(
                device=current[0],
                port=current[1],
                state=normalize_state(port_fields.get("state")),
                phys_state=normalize_phys_state(port_fields.get("phys state")),
                link_layer=normalize_link_layer(port_fields.get("link_layer")),
                rate_gbps=parse_rate_gbps(port_fields.get("rate")),
                netdev=None,
                lid=_parse_int(port_fields.get("base lid")),
            )
        )

    for line in lines:
        if m := _IBSTATUS_HEADER.match(line):
            flush()
            current, port_fields = (m.group(1), _port_number(m.group(2), "ibstatus")), {}
        elif current is not None and (m := _FIELD.match(line)):
            key = re.sub(r"\s+", " ", m.group(1).strip().lower())
            port_fields.setdefault(key, m.group(2))
    flush()
    return ports if ports else _none_found("ibstatus", lines)


# --------------------------------------------------------------------------- ibdev2netdev

_IBDEV2NETDEV = re.compile(
    r"^\s*(?:(?P<bdf>(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+)?"
    r"(?P<dev>[^\s()=]+)\s+"
    r"(?:\((?P<desc>[^)]*)\)\s*(?P<rest>.*?)\s+)?"
    r"port\s+(?P<port>\d+)\s*"
    r"(?:\((?P<pstate>[^)]*)\)\s*)?"
    r"==>\s*(?P<netdev>[^\s()#]+)?\s*"
    r"(?:\((?P<nstate>[^)]*)\))?",
    re.IGNORECASE,
)
_COMMENT = re.compile(r"\s+#.*$")


def parse_ibdev2netdev(text: str) -> list[RdmaPort]:
    """Parse ``ibdev2netdev`` and ``ibdev2netdev -v`` (also re-aligned or annotated copies).

    The plain form only shows the netdev's ``(Up)``/``(Down)``; it is mapped to state
    ``ACTIVE``/``DOWN`` (the netdev carrier follows the RDMA port). The ``-v`` form shows
    the port state itself, which wins. Link layer and rate are not reported by this tool.
    """
    lines = clean_lines(text)
    ports: list[RdmaPort] = []
    for line in lines:
        m = _IBDEV2NETDEV.match(_COMMENT.sub("", line))
        if not m:
            continue
        state = normalize_state(m.group("pstate")) if m.group("pstate") else None
        if state is None and m.group("nstate"):
            updown = m.group("nstate").strip().lower()
            state = {"up": "ACTIVE", "down": "DOWN"}.get(updown, normalize_state(updown))
        desc = (m.group("desc") or "").strip()
        fw = re.search(r"\bfw\s+(\S+)", m.group("rest") or "")
        ports.append(
            RdmaPort(
                device=m.group("dev"),
                port=_port_number(m.group("port"), "ibdev2netdev"),
                state=state,
                phys_state=None,
                link_layer=None,
                rate_gbps=None,
                netdev=m.group("netdev"),
                fw_version=fw.group(1) if fw else None,
                ca_type=desc.split(" - ")[0].strip() or None if desc else None,
            )
        )
    return ports if ports else _none_found("ibdev2netdev", lines)


# --------------------------------------------------------------------------- rdma link

_LINK_DEV = re.compile(r"^([^\s/]+)/(\d+):?$")
_LINK_KEYS = {"state", "physical_state", "netdev", "lid", "sm_lid", "lmc", "subnet_prefix"}


def _rdma_link_json(text: str) -> list[RdmaPort] | None:
    try:
        data: Any = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, list):
        return None
    ports: list[RdmaPort] = []
    for item in data:
        if not isinstance(item, dict):
            continue
        name, port = item.get("ifname"), item.get("port")
        if not isinstance(name, str) or not isinstance(port, int) or isinstance(port, bool):
            continue
        if not 0 <= port <= _MAX_PORT:
            raise ParseError(f"rdma link: port number {port} is out of range")
        netdev = item.get("netdev")
        lid = item.get("lid")
        ports.append(
            RdmaPort(
                device=name,
                port=port,
                state=normalize_state(_str_or_none(item.get("state"))),
                phys_state=normalize_phys_state(_str_or_none(item.get("physical_state"))),
                link_layer=None,
                rate_gbps=None,
                netdev=netdev if isinstance(netdev, str) else None,
                lid=lid if isinstance(lid, int) and not isinstance(lid, bool) else None,
            )
        )
    return ports


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def parse_rdma_link(text: str) -> list[RdmaPort]:
    """Parse ``rdma link [show]`` (iproute2), old ``0/1: mlx5_0/1: ...`` lines or ``rdma -j``."""
    stripped = _ANSI.sub("", text).strip()
    if stripped.startswith("["):
        from_json = _rdma_link_json(stripped)
        if from_json is not None:
            return from_json if from_json else _none_found("rdma link", clean_lines(text))
    lines = clean_lines(text)
    ports: list[RdmaPort] = []
    for line in lines:
        tokens = _COMMENT.sub("", line).split()
        if tokens and (tokens[0] == "link" or re.fullmatch(r"\d+/\d+:", tokens[0])):
            tokens = tokens[1:]  # "link mlx5_0/1 ..." or the old "0/1: mlx5_0/1: ..."
        if not tokens or not (m := _LINK_DEV.match(tokens[0])):
            continue
        values: dict[str, str] = {}
        for key, value in itertools.pairwise(tokens[1:]):
            if key in _LINK_KEYS and key not in values:
                values[key] = value
        if not values and len(tokens) > 1:
            continue  # "x/1 something" that is not an rdma link line
        ports.append(
            RdmaPort(
                device=m.group(1),
                port=_port_number(m.group(2), "rdma link"),
                state=normalize_state(values.get("state")),
                phys_state=normalize_phys_state(values.get("physical_state")),
                link_layer=None,
                rate_gbps=None,
                netdev=values.get("netdev"),
                lid=_parse_int(values.get("lid")),
            )
        )
    return ports if ports else _none_found("rdma link", lines)


# --------------------------------------------------------------------------- merging


def merge_ports(*lists: Iterable[RdmaPort]) -> list[RdmaPort]:
    """Combine records of the same ``(device, port)`` from several tools.

    For each field the first non-``None`` value wins, in argument order and then list
    order, so pass the most authoritative source first (e.g. sysfs or ``ibstat`` before
    ``ibdev2netdev``). Output order is the order in which each port first appears.
    """
    merged: dict[tuple[str, int], RdmaPort] = {}
    names = [f.name for f in fields(RdmaPort) if f.name not in {"device", "port"}]
    for ports in lists:
        for port in ports:
            key = (port.device, port.port)
            have = merged.get(key)
            if have is None:
                merged[key] = port
                continue
            updates = {
                name: getattr(port, name)
                for name in names
                if getattr(have, name) is None and getattr(port, name) is not None
            }
            if updates:
                merged[key] = replace(have, **updates)
    return list(merged.values())
