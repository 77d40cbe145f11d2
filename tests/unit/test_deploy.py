"""Deploy files: they parse, and every flag, variable, port and path they use exists.

This is our own check of what the tools cannot know (the CLI's real flags and variables);
tests/unit/test_deploy_checkers.py runs the outside checkers (hadolint, kubernetes-validate,
helm, docker-compose).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
HELM = DEPLOY / "helm" / "outbox-relay"
PLAIN_YAML = [
    *sorted((DEPLOY / "k8s").glob("*.yaml")),
    DEPLOY / "docker-compose.yml",
    DEPLOY / "otel-collector.yaml",
    HELM / "Chart.yaml",
    HELM / "values.yaml",
]
METRICS_PORT = 9464


def _docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _cli_env_vars() -> set[str]:
    """Every OUTBOX_* variable the CLI reads: each option names its variable in its help."""
    found: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            found.update(re.findall(r"\[(OUTBOX_\w+)", action.help or ""))
            for child in getattr(action, "choices", None) or {}:
                if isinstance(action.choices, dict):  # type: ignore[unreachable]
                    walk(action.choices[child])

    walk(build_parser())
    return found


def _subcommand_flags(name: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {opt for action in sub.choices[name]._actions for opt in action.option_strings}  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", PLAIN_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses(path: Path) -> None:
    assert _docs(path)


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _relay_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in _docs(path):
            if doc.get("kind") != "Deployment":
                continue
            for c in _containers(doc):
                if "outbox-relay" in c.get("image", ""):
                    out.append((path.name, doc, c))
    return out


def test_kubernetes_relays_use_real_variables_flags_ports_and_probes() -> None:
    env_vars = _cli_env_vars()
    relay_flags = _subcommand_flags("relay")
    found = _relay_containers()
    assert {name for name, _, _ in found} == {"sidecar.yaml", "relay-deployment.yaml", "relay-fleet.yaml"}
    for name, doc, c in found:
        env = {e["name"]: e for e in c.get("env", [])}
        for var in env:
            if var.startswith("OUTBOX_"):
                assert var in env_vars, f"{name}: {var} is not read by the CLI"
        # The DSN, or the list of outboxes (each with its DSN), comes from a Secret; never both.
        (source,) = [v for v in ("OUTBOX_DSN", "OUTBOX_OUTBOXES") if v in env]
        assert "secretKeyRef" in env[source]["valueFrom"], f"{name}: {source} must come from a Secret"
        assert int(env["OUTBOX_METRICS_PORT"]["value"]) == METRICS_PORT
        for arg in c.get("args", []):
            if arg.startswith("--"):
                assert arg in relay_flags, f"{name}: {arg} is not a relay flag"
        assert [p["containerPort"] for p in c["ports"]] == [METRICS_PORT]
        assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        grace = float(c["args"][c["args"].index("--grace") + 1])
        assert doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


def test_sidecar_is_native() -> None:
    (doc,) = _docs(DEPLOY / "k8s" / "sidecar.yaml")
    (relay,) = doc["spec"]["template"]["spec"]["initContainers"]
    assert relay["restartPolicy"] == "Always"


def test_compose_uses_real_commands_and_variables() -> None:
    (compose,) = _docs(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert {"postgres", "kafka", "relay", "otel-collector", "jaeger", "app", "migrate"} <= set(services)
    env_vars = _cli_env_vars()
    commands = {"migrate", "relay", "demo"}
    for name, svc in services.items():
        for var in svc.get("environment") or {}:
            if var.startswith("OUTBOX_"):
                assert var in env_vars, f"{name}: {var}"
        entry = svc.get("entrypoint")
        if entry and entry[0] == "outbox":
            assert entry[1] in commands
            flags = _subcommand_flags(entry[1])
            for arg in entry[2:]:
                if arg.startswith("--"):
                    assert arg in flags, f"{name}: {arg}"
        build = svc.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).exists()
    assert "otel-collector.yaml" in " ".join(services["otel-collector"]["volumes"])
    kafka = services["kafka"]["environment"]
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper


def test_dockerfile_references_existing_files_and_the_health_port() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for line in text.splitlines():
        m = re.match(r"COPY (?!--from)(.+) \S+$", line)
        if m:
            for src in m.group(1).split():
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    assert f"EXPOSE {METRICS_PORT}" in text
    assert "USER 10001" in text
    assert 'ENTRYPOINT ["outbox", "relay"]' in text
    assert "/livez" in text
    for var in re.findall(r"\b(OUTBOX_\w+)=", text):
        assert var in _cli_env_vars(), var


def _value(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"values.yaml has no {dotted}"
        node = node[part]
    return node


def test_helm_templates_use_defined_values_and_real_variables() -> None:
    values = yaml.safe_load((HELM / "values.yaml").read_text())
    env_vars = _cli_env_vars()
    for tpl in sorted((HELM / "templates").iterdir()):
        text = tpl.read_text()
        for ref in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text):
            _value(values, ref)
        for var in re.findall(r"name: (OUTBOX_\w+)", text):
            assert var in env_vars, f"{tpl.name}: {var}"
    chart = yaml.safe_load((HELM / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "outbox-relay"
    assert values["metrics"]["port"] == METRICS_PORT
    assert values["terminationGracePeriodSeconds"] > values["relay"]["graceSeconds"]
