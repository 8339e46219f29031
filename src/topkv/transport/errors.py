"""Errors raised by transports.

Every failure a caller can act on has its own type, so a relay can tell "retry the same
path" (:class:`ChecksumMismatch`, :class:`TransferTimeout`) from "fail over to another path"
(:class:`PeerDied`, :class:`AuthenticationFailed`) from "stop" (:class:`TransferCancelled`).
"""

from __future__ import annotations

import threading
import time

from topkv.errors import TopKVError


class TransportError(TopKVError):
    """Base class of every transport failure."""


class PeerDied(TransportError):
    """The other side closed or reset the connection (crash, kill, network loss)."""


class AuthenticationFailed(TransportError):
    """The shared-secret handshake failed: wrong secret, or the peer is not a TopKV peer."""


class TransferTimeout(TransportError):
    """No progress within the configured timeout (a hung peer or a stalled link)."""


class TransferCancelled(TransportError):
    """The transfer was cancelled by the sender or the receiver."""


class FrameRejected(TransportError):
    """A frame broke the protocol or a limit (bad magic, oversize, mismatched sizes).

    Raised *before* any buffer is allocated for the frame's contents.
    """


class ChecksumMismatch(FrameRejected):
    """The CRC-64 of received bytes differs from the one in the frame header.

    The data was corrupted in flight; the source still owns its copy and may resend.
    """


class TransportUnavailable(TransportError):
    """The requested transport cannot run here (missing library, device or OS feature)."""


class ResourceExhausted(TransportError):
    """A bounded resource (shared segments, pending transfers) is used up."""


def wait_for_release(cond: threading.Condition, deadline: float, exhausted: str) -> None:
    """Wait on ``cond`` (held by the caller) for the receiver to release KV it holds;
    :class:`ResourceExhausted` ("``exhausted``; the receiver must release() received KV")
    once ``deadline`` (:func:`time.monotonic`) has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ResourceExhausted(f"{exhausted}; the receiver must release() received KV")
    cond.wait(left)
