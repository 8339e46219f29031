"""Errors raised by the wire layer.

Every error is a :class:`WireError`, itself a :class:`topkv.errors.TopKVError`, so a caller
that handles untrusted bytes needs exactly one ``except WireError`` clause. The subclasses
say what went wrong precisely enough to decide between "retry the transfer" (corruption,
truncation) and "fix the configuration" (version, limits).
"""

from __future__ import annotations

from typing import Literal

from topkv.errors import TopKVError

ChecksumPart = Literal["header", "k", "v"]


class WireError(TopKVError):
    """Base class of every error raised while encoding or decoding KV frames."""


class BadMagic(WireError):
    """The first 8 bytes are not ``KVCACHE1``: the peer does not speak this protocol."""


class UnsupportedVersion(WireError):
    """The header's format version is not one this build can decode."""


class TruncatedFrame(WireError):
    """Fewer bytes arrived than the header (or the frame it announces) needs."""


class SizeMismatch(WireError):
    """A byte count disagrees with the dimensions times the dtype size, or a buffer has
    more or fewer bytes than its header announces."""


class SizeLimitExceeded(WireError):
    """A header field exceeds the receiver's configured :class:`WireLimits`."""


class FrameChecksumMismatch(WireError):
    """The CRC-64 of the header, of K or of V does not match the received bytes.

    ``part`` is ``"header"``, ``"k"`` or ``"v"``; ``expected`` is the CRC the frame carries,
    ``actual`` the CRC of the bytes received. Corruption in transit: retry the transfer.
    """

    def __init__(self, part: ChecksumPart, expected: int, actual: int) -> None:
        self.part: ChecksumPart = part
        self.expected = expected
        self.actual = actual
        name = {"header": "header", "k": "K tensor", "v": "V tensor"}[part]
        super().__init__(
            f"CRC-64/NVME mismatch in the {name}: frame says {expected:#018x}, "
            f"received bytes give {actual:#018x} (corrupted in transit; retry the transfer)"
        )


class HeaderCorrupt(WireError):
    """A header field has an impossible value: unknown dtype code or flag bit, a zero
    dimension, a layer index out of range, non-zero reserved bytes, or a frame kind that
    does not match the decoder called."""


class BufferLayoutError(WireError):
    """A tensor handed to the encoder or checksum is not a C-contiguous buffer."""


class UnknownDType(WireError):
    """A dtype name given to the encoder is not one the wire format can carry."""
