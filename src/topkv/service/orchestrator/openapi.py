"""The OpenAPI 3.1 document of the orchestrator's HTTP API, built from the pydantic models."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from topkv.service.messages import ErrorResponse, RegisterRequest
from topkv.service.orchestrator.adp import AdpState
from topkv.service.orchestrator.models import (
    Health,
    HeartbeatAck,
    Readiness,
    SubmitRequest,
    TopologyView,
    TransferList,
    TransferView,
    WorkerList,
    WorkerView,
)

_MODELS: tuple[type[BaseModel], ...] = (
    SubmitRequest,
    TransferView,
    TransferList,
    WorkerView,
    WorkerList,
    RegisterRequest,
    HeartbeatAck,
    TopologyView,
    Health,
    Readiness,
    ErrorResponse,
    AdpState,
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _json(ErrorResponse)}


def _id_param(name: str, description: str, integer: bool = True) -> dict[str, Any]:
    schema = {"type": "integer", "minimum": 0} if integer else {"type": "string"}
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": schema,
    }


#: GET /v1/leader: the holder (null: none), its epoch, this orchestrator's id.
_LEADER = {
    "application/json": {
        "schema": {
            "type": "object",
            "required": ["leader", "epoch", "self"],
            "properties": {
                "leader": {"type": ["string", "null"]},
                "epoch": {"type": "integer"},
                "self": {"type": "string"},
                "leader_address": {"type": ["string", "null"]},
                "acting": {"type": "boolean"},
            },
        }
    }
}


@cache
def openapi_document() -> dict[str, Any]:
    """The whole document (cached; it depends only on the code)."""
    _, defs = models_json_schema(
        [(m, "serialization") for m in _MODELS], ref_template="#/components/schemas/{model}"
    )
    schemas = defs.get("$defs", {})
    rid = _id_param("request_id", "the request id")
    wid = _id_param("worker_id", "the worker id", integer=False)
    paths: dict[str, Any] = {
        "/v1/requests": {
            "post": {
                "summary": "Submit a prefilled request's KV for transfer to a decode worker",
                "requestBody": {"required": True, "content": _json(SubmitRequest)},
                "responses": {
                    "202": {"description": "accepted (queued)", "content": _json(TransferView)},
                    "400": _error("invalid body (validation errors listed)"),
                    "409": _error("unknown prefill worker, or the request id is active"),
                    "429": _error("submission queue full: back off and retry"),
                    "502": _error("every prefill worker tried could not produce the KV"),
                    "503": _error("no healthy prefill worker with room is left"),
                },
            }
        },
        "/v1/requests/{request_id}": {
            "parameters": [rid],
            "get": {
                "summary": "Status of one request's transfer",
                "responses": {
                    "200": {"description": "the record", "content": _json(TransferView)},
                    "404": _error("no such request"),
                },
            },
            "delete": {
                "summary": "Abort: cancel the transfer and release every resource",
                "responses": {
                    "200": {"description": "the final record", "content": _json(TransferView)},
                    "404": _error("no such request"),
                },
            },
        },
        "/v1/transfers": {
            "get": {
                "summary": "Active transfers (then recent history), filtered",
                "parameters": [
                    {"name": "state", "in": "query", "schema": {"type": "string"}},
                    {"name": "worker", "in": "query", "schema": {"type": "string"}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                ],
                "responses": {
                    "200": {"description": "the listing", "content": _json(TransferList)},
                    "400": _error("bad filter"),
                },
            }
        },
        "/v1/workers": {
            "get": {
                "summary": "Registered workers and the decode slots reserved on each",
                "responses": {"200": {"description": "workers", "content": _json(WorkerList)}},
            },
            "post": {
                "summary": "Register a worker (embedded registry only; with etcd: 409)",
                "requestBody": {"required": True, "content": _json(RegisterRequest)},
                "responses": {
                    "201": {"description": "registered", "content": _json(WorkerView)},
                    "200": {"description": "registration replaced", "content": _json(WorkerView)},
                    "400": _error("invalid record"),
                    "409": _error("the registry is etcd: register there"),
                },
            },
        },
        "/v1/workers/{worker_id}/heartbeat": {
            "parameters": [wid],
            "put": {
                "summary": "Extend a worker's lease",
                "responses": {
                    "200": {"description": "extended", "content": _json(HeartbeatAck)},
                    "404": _error("unknown or expired: register again"),
                    "409": _error("the registry is etcd"),
                },
            },
        },
        "/v1/workers/{worker_id}": {
            "parameters": [wid],
            "delete": {
                "summary": "Deregister a worker",
                "responses": {
                    "204": {"description": "removed"},
                    "404": _error("not registered"),
                    "409": _error("the registry is etcd"),
                },
            },
        },
        "/v1/experts": {
            "get": {
                "summary": "The MoE expert registry (fresh replicas, load factors, stragglers)",
                "parameters": [
                    {"name": "expert", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                    {"name": "domain", "in": "query", "schema": {"type": "string"}},
                    {"name": "worker", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {"description": "expert replicas"},
                    "400": _error("a filter out of range"),
                },
            }
        },
        "/v1/topology": {
            "get": {
                "summary": "Path candidates of every prefill -> decode pair",
                "responses": {"200": {"description": "topology", "content": _json(TopologyView)}},
            }
        },
        "/v1/adp": {
            "get": {
                "summary": "Live Adaptive Decoder Pool: rush, stages, conversions (adp.md)",
                "responses": {"200": {"description": "ADP state", "content": _json(AdpState)}},
            }
        },
        "/v1/leader": {
            "get": {
                "summary": "Who leads (leader election; any caller; docs/kubernetes.md)",
                "responses": {"200": {"description": "leader", "content": _LEADER}},
            }
        },
        "/healthz": {
            "get": {
                "summary": "Liveness: the process serves HTTP",
                "responses": {"200": {"description": "alive", "content": _json(Health)}},
            }
        },
        "/readyz": {
            "get": {
                "summary": "Readiness: running, registry reachable, >= 1 prefill and decode",
                "responses": {
                    "200": {"description": "ready", "content": _json(Readiness)},
                    "503": {"description": "not ready", "content": _json(Readiness)},
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text exposition format)",
                "responses": {
                    "200": {
                        "description": "metrics",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": {"description": "OpenAPI 3.1"}},
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "TopKV orchestrator",
            "version": "1",
            "description": "Topology-aware KV-cache relay: submit prefilled requests, watch "
            "their transfers, manage workers. See docs/services.md.",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }
