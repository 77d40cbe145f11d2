"""The deploy files, checked by tools we did not write: hadolint for the Dockerfile (findings
we disagree with are ignored inline, with the reason), kubernetes-validate (strict: no unknown
fields) for the Kubernetes manifests against a stated Kubernetes version."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = "1.31.0"  # the version the manifests are validated against (README, deploy/)


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is missing: ./scripts/bootstrap installs it (dev extra)"
    return found


def test_the_dockerfile_passes_hadolint() -> None:
    done = subprocess.run(
        [_tool("hadolint"), str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_kubernetes_manifests_pass_kubernetes_validate_strict() -> None:
    manifests = sorted(str(p) for p in (ROOT / "deploy" / "k8s").glob("*.yaml"))
    assert len(manifests) >= 3
    done = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "-k", KUBERNETES, *manifests],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed for resource ") >= 4, done.stdout
