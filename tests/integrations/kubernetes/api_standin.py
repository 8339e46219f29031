"""A STAND-IN for the Kubernetes API server's Lease endpoints (coordination.k8s.io/v1) and
Node GET/PATCH, for tests only: no Kubernetes API server can run on the test machines.

It serves, over real HTTP on a loopback port, what the Lease backend calls, with the API's
rules: GET of a missing Lease is 404 (a ``Status`` with reason NotFound); POST of an existing
one is 409 AlreadyExists; PUT of a missing one is 404; PUT whose
``metadata.resourceVersion`` is not the stored one is 409 Conflict; every write bumps the
resourceVersion. GET of a Node answers it (404 when missing); PATCH with
``application/merge-patch+json`` merges the body into it (RFC 7386: ``null`` deletes), other
patch types are 415. ``fail_next`` answers the next calls with given statuses (403, 500, ...)
to exercise the backend's error handling. It is not a Kubernetes API server.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_ITEM = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases/([^/?]+)$")
_COLLECTION = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases$")
_NODE = re.compile(r"^/api/v1/nodes/([^/?]+)$")


class ApiStandIn:
    """Leases by (namespace, name), behind a lock; see the module docstring."""

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, int]] = []
        self._failures: list[int] = []
        self._version = 100
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return

            def do_GET(self) -> None:
                standin._serve(self, "GET")

            def do_POST(self) -> None:
                standin._serve(self, "POST")

            def do_PUT(self) -> None:
                standin._serve(self, "PUT")

            def do_PATCH(self) -> None:
                standin._serve(self, "PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail_next(self, *statuses: int) -> None:
        with self._lock:
            self._failures.extend(statuses)

    def put_lease(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        """Store a Lease as if some other client had written it."""
        with self._lock:
            self._version += 1
            self.leases[(namespace, name)] = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "resourceVersion": str(self._version),
                },
                "spec": spec,
            }

    def _serve(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = handler.path.split("?", 1)[0]
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length)) if length else None
        node = _NODE.match(path)
        with self._lock:
            if node is not None and not self._failures:
                content_type = handler.headers.get("Content-Type", "")
                status, answer = self._node(method, node[1], body, content_type)
            else:
                status, answer = self._answer(method, path, body)
            self.calls.append((method, path, status))
        data = json.dumps(answer).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _answer(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        if self._failures:
            code = self._failures.pop(0)
            return code, _status(code, "InjectedFailure", f"injected {code}")
        item, collection = _ITEM.match(path), _COLLECTION.match(path)
        if method == "GET" and item:
            lease = self.leases.get((item[1], item[2]))
            if lease is None:
                return 404, _status(404, "NotFound", f'leases "{item[2]}" not found')
            return 200, lease
        if method == "POST" and collection:
            name = body["metadata"]["name"]
            if (collection[1], name) in self.leases:
                return 409, _status(409, "AlreadyExists", f'leases "{name}" already exists')
            return 201, self._store(collection[1], name, body)
        if method == "PUT" and item:
            key = (item[1], item[2])
            stored = self.leases.get(key)
            if stored is None:
                return 404, _status(404, "NotFound", f'leases "{item[2]}" not found')
            version = body.get("metadata", {}).get("resourceVersion")
            if version is not None and version != stored["metadata"]["resourceVersion"]:
                return 409, _status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on leases.coordination.k8s.io "{item[2]}": '
                    "the object has been modified; please apply your changes to the latest "
                    "version and try again",
                )
            return 200, self._store(item[1], item[2], body)
        return 404, _status(404, "NotFound", f"the stand-in does not serve {method} {path}")

    def _node(
        self, method: str, name: str, body: Any, content_type: str
    ) -> tuple[int, dict[str, Any]]:
        node = self.nodes.get(name)
        if node is None:
            return 404, _status(404, "NotFound", f'nodes "{name}" not found')
        if method == "GET":
            return 200, node
        if method == "PATCH":
            if not content_type.startswith("application/merge-patch+json"):
                return 415, _status(415, "UnsupportedMediaType", content_type)
            self.nodes[name] = _merge(node, body)
            return 200, self.nodes[name]
        return 405, _status(405, "MethodNotAllowed", method)

    def _store(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        lease = json.loads(json.dumps(body))
        lease.setdefault("apiVersion", "coordination.k8s.io/v1")
        lease.setdefault("kind", "Lease")
        lease["metadata"] = {
            **lease.get("metadata", {}),
            "name": name,
            "namespace": namespace,
            "resourceVersion": str(self._version),
        }
        self.leases[(namespace, name)] = lease
        return lease


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result
