"""Shared-secret challenge-response handshake (HMAC-SHA256, mutual).

The server speaks first with a random challenge; the client proves it knows the secret; the
server proves it too. The server reads one fixed 48-byte answer and verifies it before it
reads or allocates anything else, so an unauthenticated peer costs nothing but a socket.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from topkv.transport.errors import AuthenticationFailed, PeerDied, TransferTimeout
from topkv.transport.stream.sockio import recv_exactly, send_buffers

HELLO = b"TKVHELLO"
NONCE_SIZE = 16
MAC_SIZE = 32


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Authenticate a freshly accepted connection; raises AuthenticationFailed."""
    server_nonce = os.urandom(NONCE_SIZE)
    send_buffers(sock, [HELLO + server_nonce])
    try:
        answer = recv_exactly(sock, NONCE_SIZE + MAC_SIZE, "handshake answer")
    except (PeerDied, TransferTimeout) as exc:
        raise AuthenticationFailed(f"peer did not complete the handshake: {exc}") from exc
    client_nonce, mac = answer[:NONCE_SIZE], answer[NONCE_SIZE:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", server_nonce, client_nonce)):
        raise AuthenticationFailed("peer does not know the shared secret")
    send_buffers(sock, [_mac(secret, b"server", client_nonce, server_nonce)])


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Authenticate to a server; raises AuthenticationFailed if either side's proof fails."""
    try:
        hello = recv_exactly(sock, len(HELLO) + NONCE_SIZE, "handshake challenge")
        if hello[: len(HELLO)] != HELLO:
            raise AuthenticationFailed("peer is not a TopKV transport endpoint")
        server_nonce = hello[len(HELLO) :]
        client_nonce = os.urandom(NONCE_SIZE)
        send_buffers(sock, [client_nonce + _mac(secret, b"client", server_nonce, client_nonce)])
        proof = recv_exactly(sock, MAC_SIZE, "handshake proof")
    except PeerDied as exc:
        raise AuthenticationFailed(
            "peer closed the connection during the handshake (wrong shared secret?)"
        ) from exc
    if not hmac.compare_digest(proof, _mac(secret, b"server", client_nonce, server_nonce)):
        raise AuthenticationFailed("peer failed to prove it knows the shared secret")
