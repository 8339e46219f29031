"""Blocking socket helpers that turn OS errors into transport errors.

Every call runs under a timeout set by the caller, so a silent peer surfaces as
:class:`TransferTimeout` and a dead one as :class:`PeerDied`, never as a hang.

Two ways to set it: Python's ``sock.settimeout(s)`` (the socket becomes non-blocking and every
call polls first: fine for small records) or :func:`set_io_timeout` for bulk data: the
socket stays *blocking* and the kernel enforces the timeout (``SO_SNDTIMEO`` /
``SO_RCVTIMEO``), so one ``sendmsg`` moves a whole layer and one ``recv_into(...,
MSG_WAITALL)`` fills a whole chunk in a single system call each, like a raw blocking
``sendall`` / ``recv_into``. (With ``settimeout`` a 8 MiB layer took dozens of
poll + partial-send round trips through Python.)
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from topkv.transport.errors import PeerDied, TransferTimeout


def set_io_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Blocking mode with a kernel-enforced send/receive timeout (None: wait forever)."""
    sock.settimeout(None)
    whole = int(seconds) if seconds is not None else 0
    micro = int((seconds - whole) * 1e6) if seconds is not None else 0
    if seconds is not None and whole == 0 and micro == 0:
        micro = 1  # 0 would mean "no timeout" to the kernel
    timeval = struct.pack("@ll", whole, micro)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _timeout_text(sock: socket.socket) -> str:
    timeout = sock.gettimeout()
    if timeout is None:
        whole, micro = struct.unpack(
            "@ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("@ll"))
        )
        timeout = whole + micro / 1e6
    return f"{timeout:g} s"


def recv_into_exactly(sock: socket.socket, view: memoryview, what: str = "data") -> None:
    """Fill ``view`` completely from ``sock`` (one ``MSG_WAITALL`` call when blocking)."""
    got = 0
    size = len(view)
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    try:
        while got < size:
            n = sock.recv_into(view[got:], 0, flags)
            if n == 0:
                raise PeerDied(f"peer closed the connection while sending {what}")
            got += n
    except (TimeoutError, BlockingIOError) as exc:
        raise TransferTimeout(f"no {what} from peer within {_timeout_text(sock)}") from exc
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise PeerDied(f"connection reset while receiving {what}: {exc}") from exc


def recv_exactly(sock: socket.socket, size: int, what: str = "data") -> bytes:
    """Receive exactly ``size`` bytes (for small, bounded records only)."""
    buf = bytearray(size)
    recv_into_exactly(sock, memoryview(buf), what)
    return bytes(buf)


def send_buffers(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """Send every buffer, in order, with scatter-gather ``sendmsg`` (no copies in Python)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    try:
        while views:
            sent = sock.sendmsg(views)
            while sent:
                head = views[0]
                if sent >= len(head):
                    sent -= len(head)
                    views.pop(0)
                else:
                    views[0] = head[sent:]
                    sent = 0
    except (TimeoutError, BlockingIOError) as exc:
        raise TransferTimeout(f"peer accepted no data within {_timeout_text(sock)}") from exc
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise PeerDied(f"peer closed the connection: {exc}") from exc
