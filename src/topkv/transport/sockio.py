"""Blocking socket helpers that turn OS errors into transport errors.

Every call runs under the socket's timeout (set by the caller), so a silent peer surfaces as
:class:`TransferTimeout` and a dead one as :class:`PeerDied`, never as a hang.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from topkv.transport.errors import PeerDied, TransferTimeout


def recv_into_exactly(sock: socket.socket, view: memoryview, what: str = "data") -> None:
    """Fill ``view`` completely from ``sock``."""
    got = 0
    size = len(view)
    try:
        while got < size:
            n = sock.recv_into(view[got:])
            if n == 0:
                raise PeerDied(f"peer closed the connection while sending {what}")
            got += n
    except TimeoutError as exc:
        raise TransferTimeout(f"no {what} from peer within {sock.gettimeout()} s") from exc
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
    except TimeoutError as exc:
        raise TransferTimeout(f"peer accepted no data within {sock.gettimeout()} s") from exc
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise PeerDied(f"peer closed the connection: {exc}") from exc
