"""The deploy files, checked by tools we did not write: hadolint for the Dockerfile (findings
we disagree with are ignored inline, with the reason); kubernetes-validate (strict: no unknown
fields) for the Kubernetes manifests against a stated Kubernetes version; helm (lint, and the
chart rendered with its default values and with a second values file, each rendering then
through kubernetes-validate); docker-compose's own `config` for the compose file. Each checker
is also shown a broken input, so a checker that accepts anything fails here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.same_on_every_python

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = "1.31.0"  # the version the manifests are validated against (README, deploy/)
CHART = ROOT / "deploy" / "helm" / "outbox-relay"
SECOND_VALUES = CHART / "ci" / "production-values.yaml"


def _tool(name: str) -> str:
    # This interpreter's environment, then the main .venv (bootstrap puts helm there; the
    # py-matrix environments have none), then PATH (Debian's docker-compose).
    found = (
        shutil.which(name, path=str(Path(sys.executable).parent))
        or shutil.which(name, path=str(ROOT / ".venv" / "bin"))
        or shutil.which(name)
    )
    assert found, f"{name} is missing: ./scripts/bootstrap installs it"
    return found


def _validate(paths: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "-k", KUBERNETES, *paths],
        capture_output=True,
        text=True,
    )


def test_the_dockerfile_passes_hadolint() -> None:
    done = subprocess.run(
        [_tool("hadolint"), str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_refuses_an_untagged_base_image(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python\nRUN pip install outbox-relay\n")
    done = subprocess.run([_tool("hadolint"), str(broken)], capture_output=True, text=True)
    assert done.returncode != 0 and "DL3006" in done.stdout, done.stdout


def test_the_kubernetes_manifests_pass_kubernetes_validate_strict() -> None:
    manifests = sorted(str(p) for p in (ROOT / "deploy" / "k8s").glob("*.yaml"))
    assert len(manifests) >= 3
    done = _validate(manifests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed for resource ") >= 4, done.stdout


def test_kubernetes_validate_refuses_an_unknown_field(tmp_path: Path) -> None:
    (doc,) = [
        d
        for d in yaml.safe_load_all((ROOT / "deploy/k8s/relay-deployment.yaml").read_text())
        if d and d["kind"] == "Deployment"
    ]
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"path": "/readyz"}
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(doc))
    done = _validate([str(broken)])
    assert done.returncode != 0 and "readinesProbe" in done.stdout + done.stderr


def _render(values: Path | None) -> str:
    extra = ["--values", str(values)] if values else []
    lint = subprocess.run(
        [_tool("helm"), "lint", "--strict", str(CHART), *extra], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    done = subprocess.run(
        [_tool("helm"), "template", "orders", str(CHART), *extra], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("values", [None, SECOND_VALUES], ids=["default-values", "second-values"])
def test_the_helm_chart_renders_and_each_manifest_passes_kubernetes_validate(
    values: Path | None, tmp_path: Path
) -> None:
    rendered = _render(values)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    # The Prometheus Operator's objects are off by default; the second values turn them on.
    operator = ["PrometheusRule", "ServiceMonitor"] if values else []
    verify = ["CronJob"] if values else []  # outbox verify on a schedule, off by default too
    assert sorted(d["kind"] for d in docs) == sorted(["Deployment", "Service", *operator, *verify])
    core = [d for d in docs if d["kind"] not in operator]  # kubernetes-validate knows no CRD
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(core))
    done = _validate([str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed for resource ") == 2 + len(verify), done.stdout
    if values:
        _check_operator_objects(docs, yaml.safe_load(values.read_text()))
    wanted = yaml.safe_load((values or CHART / "values.yaml").read_text())
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (relay,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in relay["env"]}
    assert deployment["spec"]["replicas"] == wanted["replicaCount"]
    assert env["OUTBOX_DSN"]["valueFrom"]["secretKeyRef"]["name"] == wanted["dsnSecret"]["name"]
    assert relay["ports"][0]["containerPort"] == wanted["metrics"]["port"]
    if values:  # the second file turns on every optional branch, each from a Secret
        for var in ("OUTBOX_KAFKA_CONFIG", "OUTBOX_ROUTES", "OUTBOX_WEBHOOK_SECRET"):
            assert "secretKeyRef" in env[var]["valueFrom"], var
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == wanted["otel"]["endpoint"]
        _check_verify_job(docs, wanted, env)


def _check_verify_job(docs: list[Any], wanted: dict[str, Any], relay_env: dict[str, Any]) -> None:
    """The CronJob runs `outbox verify` on the relays' outbox with the relays' sinks (the same
    variables, from the same Secrets), and fails its Job rather than retrying a loss."""
    (job,) = [d for d in docs if d["kind"] == "CronJob"]
    assert job["spec"]["schedule"] == wanted["verify"]["schedule"]
    spec = job["spec"]["jobTemplate"]["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"] == ["outbox", "verify"] and spec["backoffLimit"] == 0
    assert container["args"] == [
        "--since",
        wanted["verify"]["since"],
        "--rate",
        str(wanted["verify"]["rate"]),
    ]
    env = {e["name"]: e for e in container["env"]}
    for var in ("OUTBOX_DSN", "OUTBOX_KAFKA_BOOTSTRAP", "OUTBOX_KAFKA_CONFIG", "OUTBOX_ROUTES"):
        assert env[var] == relay_env[var], var
    assert env["OUTBOX_SCHEMA"]["value"] == wanted["schema"]


def _check_operator_objects(docs: list[Any], wanted: dict[str, Any]) -> None:
    """The PrometheusRule holds exactly the shipped rules; the ServiceMonitor scrapes the metrics
    Service by its labels and its port's name."""
    by_kind = {d["kind"]: d for d in docs}
    rule, monitor, service = by_kind["PrometheusRule"], by_kind["ServiceMonitor"], by_kind["Service"]
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "outbox-relay-rules.yaml").read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["spec"] == shipped
    assert rule["metadata"]["labels"]["release"] == wanted["prometheusRule"]["labels"]["release"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == wanted["serviceMonitor"]["interval"]


def test_helm_refuses_a_broken_template(tmp_path: Path) -> None:
    chart = tmp_path / "outbox-relay"
    shutil.copytree(CHART, chart)
    deployment = chart / "templates" / "deployment.yaml"
    deployment.write_text(
        deployment.read_text().replace("{{ .Values.replicaCount }}", "{{ .Values.replicaCount ")
    )
    done = subprocess.run([_tool("helm"), "template", "x", str(chart)], capture_output=True, text=True)
    assert done.returncode != 0 and "deployment.yaml" in done.stderr


def _compose_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("docker-compose"), "-f", str(path), "config", "-q"], capture_output=True, text=True
    )


@pytest.mark.parametrize("name", ["docker-compose.yml", "quickstart.yml"])
def test_the_compose_files_pass_docker_compose_config(name: str) -> None:
    done = _compose_config(ROOT / "deploy" / name)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_quickstart_servers_are_the_readmes() -> None:
    """deploy/quickstart.yml and the README's two docker lines: the same images, the same ports."""
    services = yaml.safe_load((ROOT / "deploy" / "quickstart.yml").read_text())["services"]
    readme = (ROOT / "README.md").read_text()
    for service in services.values():
        [port] = service["ports"]
        assert f"-p {port} " in readme and f" {service['image']}\n" in readme, service
    assert "POSTGRES_PASSWORD=postgres -e POSTGRES_DB=shop" in readme


def test_docker_compose_config_refuses_a_bad_condition(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    text = (ROOT / "deploy" / "docker-compose.yml").read_text()
    broken.write_text(text.replace("service_healthy", "service_ready"))
    done = _compose_config(broken)
    assert done.returncode != 0 and "service_ready" in done.stderr


@pytest.mark.parametrize(
    ("settings", "present", "absent"),
    [
        ([], {"OUTBOX_DSN", "OUTBOX_SCHEMA"}, {"OUTBOX_OUTBOXES", "OUTBOX_SCHEMAS"}),
        (
            ["outboxes.listSecret.name=outbox-outboxes"],
            {"OUTBOX_OUTBOXES", "OUTBOX_MAX_CONNECTIONS"},
            {"OUTBOX_DSN", "OUTBOX_SCHEMA", "OUTBOX_SCHEMAS"},
        ),
        (
            ["outboxes.schemas=tenant_*"],
            {"OUTBOX_DSN", "OUTBOX_SCHEMAS", "OUTBOX_DISCOVER_EVERY"},
            {"OUTBOX_OUTBOXES", "OUTBOX_SCHEMA"},
        ),
    ],
    ids=["one-outbox", "list-from-a-secret", "schema-glob"],
)
def test_the_chart_takes_one_outbox_a_list_from_a_secret_or_a_schema_glob(
    settings: list[str], present: set[str], absent: set[str]
) -> None:
    """The relay refuses --dsn next to a list of outboxes: the chart never renders both."""
    rendered = subprocess.run(
        [_tool("helm"), "template", "orders", str(CHART), *[a for s in settings for a in ("--set", s)]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (deployment,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert present <= set(env) and not (absent & set(env)), sorted(env)
    if "OUTBOX_OUTBOXES" in env:
        assert env["OUTBOX_OUTBOXES"]["valueFrom"]["secretKeyRef"]["name"] == "outbox-outboxes"
