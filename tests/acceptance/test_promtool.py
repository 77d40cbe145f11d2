"""``/metrics`` checked by Prometheus's own linter: ``promtool check metrics`` (Debian package
``prometheus``, installed by ./scripts/bootstrap) on a scrape of a running relay after
deliveries, retries and a dead letter, so every family has samples to check. And what ships for
it: the alert rules (``promtool check rules`` and their unit tests), the Grafana dashboard (as
its generator makes it), and every expression of both, parsed, naming only exported metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import promql_parser
import psycopg
import yaml

import outbox
from outbox.relay.config import RelayConfig
from outbox.relay.retry import RetryPolicy
from outbox.sinks.kafka import KafkaSink
from tests.helpers import count, http_get, running_relay, wait_for
from tests.sinks import AnyFlakySink


def _scraped(pg_dsn: str, schema: str, kafka: str, topic: str) -> str:
    """A running relay's /metrics after deliveries, retries and a dead letter: every family has
    samples."""
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn,
            [{"topic": topic, "payload": {"i": i}, "key": f"k{i % 5}"} for i in range(200)],
            schema=schema,
        )
        outbox.enqueue(conn, "not a valid topic!", b"x", key="poison", schema=schema)  # dead at once
        conn.commit()
    config = RelayConfig(
        pg_dsn, schema=schema, metrics_port=0, poll_interval=0.1, retry=RetryPolicy(base=0.05, cap=0.2)
    )

    def flaky() -> AnyFlakySink:
        return AnyFlakySink(KafkaSink(kafka, delivery_timeout=config.delivery_timeout), 0.2)

    with running_relay(config, flaky) as relay:
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="drain")
        assert relay.stats.retried > 0 and count(pg_dsn, schema, "dead_letters") == 1
        status, body = http_get(relay.http.port, "/metrics")  # type: ignore[union-attr]
    assert status == 200
    assert "outbox_events_dead_total{" in body and "outbox_delivery_errors_total{" in body, body[:800]
    return body


def test_metrics_pass_promtool_check_metrics(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: ./scripts/bootstrap installs the Debian package prometheus"
    body = _scraped(pg_dsn, schema, kafka, topic)
    checked = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "outbox-relay-rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "outbox-relay.json"
# Grafana's variables, as a query would have them filled in.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "${datasource}": "prometheus", "$outbox": ".*"}


def _expressions() -> dict[str, str]:
    """Every PromQL expression that ships: each alert's, each dashboard target's (by where)."""
    found: dict[str, str] = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            found[f"rule {rule['alert']}"] = rule["expr"]
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            found[f"panel {panel['title']!r} {target['refId']}"] = expr
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(METRIC, LABEL): Grafana's, not PromQL
            metric = variable["query"].removeprefix("label_values(").split(",")[0]
            found[f"variable {variable['name']}"] = metric
    return found


def _metrics_named(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_the_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: ./scripts/bootstrap installs the Debian package prometheus"
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS: 15 rules found" in checked.stdout, (
        checked.stdout + checked.stderr
    )
    tested = subprocess.run(
        [promtool, "test", "rules", "outbox-relay-rules.test.yaml"],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
    )
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    # Each alert is tested, firing and quiet.
    tests = yaml.safe_load((RULES.parent / "outbox-relay-rules.test.yaml").read_text())["tests"]
    evals = [e for t in tests for e in t["alert_rule_test"]]
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert {e["alertname"] for e in evals if e["exp_alerts"]} == alerts
    assert {e["alertname"] for e in evals if not e["exp_alerts"]} == alerts


def test_the_dashboard_is_what_its_generator_makes() -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "grafana-dashboard"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    dashboard = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "outbox"]
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Backlog",
        "Oldest pending age",
        "Delivery errors, by type",
        "Dead letters",
        "Delivery latency",
    } <= titles


def test_every_shipped_expression_parses_and_names_metrics_a_live_relay_exports(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    """Renaming a metric breaks this test, not an operator's pager: every expression of the alert
    rules and the dashboard parses, and each metric it names is on a live relay's /metrics after
    deliveries, retries and a dead letter."""
    expressions = _expressions()
    assert len(expressions) >= 14 + 10
    named = {where: _metrics_named(expr) for where, expr in expressions.items()}
    body = _scraped(pg_dsn, schema, kafka, topic)
    exported = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE ")}
    # A histogram's series: NAME_bucket, NAME_sum, NAME_count.
    exported |= {f"{name}{suffix}" for name in exported for suffix in ("_bucket", "_sum", "_count")}
    unknown = {where: sorted(names - exported) for where, names in named.items() if names - exported}
    assert unknown == {}, unknown
    assert all(named.values()), [where for where, names in named.items() if not names]
