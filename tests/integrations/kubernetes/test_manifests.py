"""The manifests in deploy/: each overlay renders with ``kubectl kustomize`` (Debian's
kubernetes-client), every object validates offline against the Kubernetes 1.31 schema
(``kubernetes-validate``, strict), RBAC grants nothing beyond Lease get/update/create in the
namespace and Node get/patch, and the objects the issue names are there as it says."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
OVERLAYS = ["base", "overlays/with-etcd", "overlays/prometheus"]
K8S_VERSION = "1.31.0"
#: Everything RBAC may grant: (apiGroup, resource, verb, namespaced).
ALLOWED = {
    *(("coordination.k8s.io", "leases", verb, True) for verb in ("get", "update", "create")),
    *(("", "nodes", verb, False) for verb in ("get", "patch")),
}
#: Kinds outside the built-in schema (CRDs), checked by hand below.
CRD_KINDS = {"ServiceMonitor"}


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (apt-get install kubernetes-client)")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    docs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    assert docs, f"{overlay} rendered nothing"
    return docs


def _objects(overlay: str, kind: str) -> Iterator[dict[str, Any]]:
    return (d for d in render(overlay) if d["kind"] == kind)


def _one(overlay: str, kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _objects(overlay, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_schema(overlay: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in render(overlay):
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {exc}") from None
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace") == "topkv", doc["metadata"]


def test_a_broken_manifest_is_caught() -> None:
    """The validation can fail: a Deployment with a misspelt field does not pass."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = _one("base", "Deployment", "topkv-orchestrator")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_grants_nothing_beyond_leases_and_nodes(overlay: str) -> None:
    granted: set[tuple[str, str, str, bool]] = set()
    for doc in render(overlay):
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        assert "aggregationRule" not in doc
        for rule in doc["rules"]:
            assert "nonResourceURLs" not in rule, rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb), rule
                        granted.add((group, resource, verb, doc["kind"] == "Role"))
    assert granted <= ALLOWED, granted - ALLOWED
    assert granted == ALLOWED  # and what leader election and label-node need is there
    bindings = {
        d["roleRef"]["name"]: [s["name"] for s in d["subjects"]]
        for d in render(overlay)
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
    }
    assert bindings == {
        "topkv-orchestrator-leader-election": ["topkv-orchestrator"],
        "topkv-label-publisher": ["topkv-label-publisher"],
    }


def test_the_objects_the_issue_names() -> None:
    overlay = "overlays/prometheus"
    orch = _one(overlay, "Deployment", "topkv-orchestrator")
    assert orch["spec"]["replicas"] == 2
    (container,) = orch["spec"]["template"]["spec"]["containers"]
    assert "--leader-elect=k8s" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert orch["spec"]["template"]["spec"]["serviceAccountName"] == "topkv-orchestrator"
    for role in ("prefill", "decode"):
        worker = _one(overlay, "StatefulSet", f"topkv-{role}")["spec"]["template"]["spec"]
        assert worker["hostIPC"] is True
        (wc,) = worker["containers"]
        assert wc["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert f"--role={role}" in wc["args"]
    publisher = _one(overlay, "DaemonSet", "topkv-label-publisher")
    assert "topkv label-node" in publisher["spec"]["template"]["spec"]["containers"][0]["args"][0]
    service = _one(overlay, "Service", "topkv-orchestrator")
    monitor = _one(overlay, "ServiceMonitor", "topkv-orchestrator")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }
    assert _one(overlay, "PodDisruptionBudget", "topkv-orchestrator")["spec"]["minAvailable"] == 1
    worker_policy = _one(overlay, "NetworkPolicy", "topkv-worker")["spec"]
    sources = [
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        for rule in worker_policy["ingress"]
        for peer in rule["from"]
    ]
    assert sorted(sources) == ["topkv-orchestrator", "topkv-worker"]
    # Tokens come from Secrets, never inline.
    volumes = orch["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["secret"]["secretName"] == "topkv-tokens"
    assert not list(_objects(overlay, "Secret"))
    # etcd only in the overlay that asks for it.
    assert list(_objects("overlays/with-etcd", "StatefulSet"))
    assert not [d for d in render("base") if d["metadata"]["name"] == "topkv-etcd"]


def test_the_readme_names_the_render_command() -> None:
    text = (DEPLOY / "README.md").read_text()
    assert "kubectl kustomize deploy/overlays/with-etcd" in text
