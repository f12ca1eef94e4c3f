"""Kubernetes identity of the exporter: exported when present, flagged when missing, absent outside Kubernetes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from frexporter import naming as n
from frexporter.outputs.identity import IdentityCollector
from tests.harness import metrics, sample


def render(env: dict[str, str]) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(IdentityCollector(env))
    return metrics(generate_latest(registry).decode())


def test_outside_kubernetes_nothing_is_claimed() -> None:
    assert render({"POD_NAME": "x"}) == {}


def test_missing_downward_api_fields_are_flagged() -> None:
    parsed = render({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "POD_NAME": "trainer-0", "POD_NAMESPACE": "ml"})
    assert sample(parsed, n.EXPORTER_INFO, pod="trainer-0", namespace="ml", node="") == 1
    assert sample(parsed, n.EXPORTER_IDENTITY_MISSING, label="node") == 1
    assert len(parsed[n.EXPORTER_IDENTITY_MISSING]) == 1


def test_complete_identity_has_no_missing_series() -> None:
    parsed = render({"KUBERNETES_SERVICE_HOST": "h", "POD_NAME": "p", "POD_NAMESPACE": "ns", "NODE_NAME": "n1"})
    assert sample(parsed, n.EXPORTER_INFO, pod="p", namespace="ns", node="n1") == 1
    assert parsed.get(n.EXPORTER_IDENTITY_MISSING, []) == []
