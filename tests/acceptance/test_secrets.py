"""Secrets (DSN passwords, SASL passwords) never reach logs, errors, status output or metrics."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox.harness.embedded import free_port
from tests.helpers import RelayProcess, http_get, wait_for


def test_secrets_never_reach_logs_errors_status_or_metrics(pg_dsn: str, schema: str, kafka: str) -> None:
    """A DSN password and a SASL password, with errors provoked on both sides."""
    pw, sasl = "PgSecret-7f3a", "SaslSecret-91bc"
    port = free_port()
    dsn = make_conninfo(**{**conninfo_to_dict(pg_dsn), "password": pw})  # trust auth ignores it
    relay = RelayProcess(
        dsn,
        schema,
        "127.0.0.1:1",  # no broker there: connection errors are logged
        "--kafka-config",
        "security.protocol=SASL_PLAINTEXT",
        "--kafka-config",
        "sasl.mechanism=PLAIN",
        "--kafka-config",
        "sasl.username=u",
        "--kafka-config",
        f"sasl.password={sasl}",
        "--metrics-port",
        str(port),
        "--log-level",
        "debug",
    )
    scraped = []
    try:
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue(conn, "t", b"x", schema=schema)

        # Until the relay serves its endpoints and has tried (and failed) to reach the broker.
        def serving_and_failing() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=2):
                    pass
            except OSError:
                return False
            return "cannot reach the kafka brokers" in relay.output().lower()

        wait_for(serving_and_failing, timeout=30, what="endpoints up and the broker outage logged")
        scraped += [http_get(port, path)[1] for path in ("/metrics", "/readyz", "/livez")]
        relay.proc.send_signal(signal.SIGTERM)
        relay.proc.wait(30)
        logs = relay.output()
    finally:
        relay.close()
    assert "delivery" in logs.lower() or "kafka" in logs.lower(), logs[-1000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    status = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--dsn", dsn, "--schema", schema],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "outbox",
            "status",
            "--schema",
            schema,
            "--dsn",
            dsn.replace("dbname=", "dbname=nope_"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode != 0
    assert "outbox_events_delivered_total" in scraped[0] or "outbox_" in scraped[0], scraped[0][:500]
    for text in (logs, status.stdout, status.stderr, bad.stdout, bad.stderr, *scraped):
        assert pw not in text and sasl not in text


def test_secrets_never_reach_the_output_of_any_cli_command(pg_dsn: str, schema: str, kafka: str) -> None:
    """Every command, with the password in keyword and URL DSNs, working and failing."""
    pw, sasl, keypass = "PgSecret-c41d", "SaslSecret-0e27", "SslKeyPass-93aa"
    parts = conninfo_to_dict(pg_dsn)
    # Trust auth ignores the password; without a client key, libpq never uses sslpassword.
    good = make_conninfo(**{**parts, "password": pw, "sslpassword": keypass})
    url = f"postgresql://{parts.get('user', 'root')}:{pw}@{parts.get('host', '127.0.0.1')}:{parts.get('port', 5432)}"
    broken = [
        f"{url}/nope_db",
        make_conninfo(**{**parts, "password": pw, "sslpassword": keypass, "dbname": "nope_db"}),
        f"{url}x/test",
        f"{url}/nope_db?sslpassword={keypass}",
    ]
    sasl_args = ["--kafka-config", "security.protocol=SASL_PLAINTEXT", "--kafka-config", "sasl.mechanism=PLAIN",
                 "--kafka-config", "sasl.username=u", "--kafka-config", f"sasl.password={sasl}"]  # fmt: skip
    commands = [
        ["migrate"],
        ["status"],
        ["status", "--json"],
        ["dead", "list"],
        ["dead", "redrive", "--all", "--dry-run"],
        ["retry", "--dry-run"],
        ["replay", "--since", "1h", "--dry-run"],
        ["replay", "--since", "1h", "--yes"],
        [
            "replay",
            "--since",
            "1h",
            "--typo",
            "--kafka-bootstrap",
            "127.0.0.1:1",
            *sasl_args,
        ],  # argparse error
        ["purge", "--older-than", "30d", "--dry-run"],
        ["verify", "--since", "1h", "--kafka-bootstrap", "127.0.0.1:1", *sasl_args],
        ["verify", "--since", "1h", "--route", f"*=redis://:{sasl}@127.0.0.1:1/0", "--json"],
        ["notify", "on"],
        ["relay", "--kafka-bootstrap", "127.0.0.1:1", "--grace", "0", *sasl_args],
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    outputs = []
    failures = 0
    for dsn in [good, *broken]:
        for command in commands:
            try:
                out = subprocess.run(
                    [sys.executable, "-m", "outbox", *command, "--dsn", dsn, "--schema", schema],
                    capture_output=True, text=True, env=env, timeout=15,
                )  # fmt: skip
                failures += out.returncode != 0
                outputs.append((command, dsn, out.stdout + out.stderr))
            except subprocess.TimeoutExpired as exc:  # the relay runs until stopped: what it said so far
                text = (exc.stdout or b"") + (exc.stderr or b"")
                outputs.append((command, dsn, text.decode() if isinstance(text, bytes) else text))
    # With env DSN too (OUTBOX_DSN), as a sidecar would be configured.
    out = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--schema", schema],
        capture_output=True, text=True, env={**env, "OUTBOX_DSN": broken[0]}, timeout=15,
    )  # fmt: skip
    outputs.append((["status (OUTBOX_DSN)"], broken[0], out.stdout + out.stderr))
    assert failures >= 4 * len(commands) - 4, "the broken DSNs should make (nearly) every command fail"
    assert any("nope_db" in text for _, _, text in outputs), "errors should still say what is wrong"
    for command, dsn, text in outputs:
        assert pw not in text and sasl not in text and keypass not in text, (command, dsn, text[-2000:])


def test_sink_passwords_and_the_webhook_secret_never_reach_logs_errors_status_or_metrics(
    pg_dsn: str, schema: str
) -> None:
    """Every sink with a password in its URL, each failing (refused login, AUTH refused,
    HTTP 500), and a webhook signing secret: none of them appears anywhere."""
    from tests.sink_servers import Receiver

    secrets = {
        "amqp": "AmqpSecret-5d1e",
        "redis": "RedisSecret-77af",
        "nats": "NatsSecret-0c3b",
        "http": "HttpSecret-a9e2",
        "token": "HttpToken-3b8f",
        "path": "HttpPathToken-61dc",  # a Slack-style hook's token is in its path
    }
    raw_key = b"WebhookSecret-e4c1-never-shown"
    whsec = "whsec_" + base64.b64encode(raw_key).decode()
    receiver = Receiver(respond=lambda r: (500, {}, b"server error"))
    port = free_port()
    routes = "\n".join(
        [
            f"a.*=amqp://guest:{secrets['amqp']}@127.0.0.1:5672/?exchange=secrets-test",
            f"r.*=redis://:{secrets['redis']}@127.0.0.1:6379/0",
            f"n.*=nats://user:{secrets['nats']}@127.0.0.1:4222",
            f"h.*=http://user:{secrets['http']}@127.0.0.1:{receiver.port}/services/{secrets['path']}"
            f"?token={secrets['token']}",
        ]
    )
    env = {"OUTBOX_ROUTES": routes, "OUTBOX_WEBHOOK_SECRET": whsec}
    relay = RelayProcess(pg_dsn, schema, None, "--metrics-port", str(port), "--log-level", "debug", env=env)
    scraped = []
    try:
        with psycopg.connect(pg_dsn) as conn:
            for t in ("a.x", "r.x", "n.x", "h.x"):  # a key each: a key waits behind its failure
                outbox.enqueue(conn, t, b"x", key=t, schema=schema)

        def all_failed() -> bool:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                row = conn.execute(
                    sql.SQL("SELECT count(*) FROM {}.events WHERE attempts > 0").format(
                        sql.Identifier(schema)
                    )
                ).fetchone()
            return row is not None and row[0] >= 3 and receiver.requests != []

        wait_for(all_failed, timeout=60, what="failed attempts on the sinks")
        scraped += [http_get(port, path)[1] for path in ("/metrics", "/readyz", "/livez")]
        relay.proc.send_signal(signal.SIGTERM)
        relay.proc.wait(30)
        logs = relay.output()
    finally:
        relay.close()
        receiver.close()
    env_clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    status = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--dsn", pg_dsn, "--schema", schema],
        capture_output=True, text=True, env=env_clean, timeout=60,
    )  # fmt: skip
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        errors = [
            str(r[0])
            for r in conn.execute(
                sql.SQL("SELECT last_error FROM {}.events").format(sql.Identifier(schema))
            ).fetchall()
        ]
    assert any("HTTP 500" in e for e in errors) and any("amqp" in e for e in errors), errors
    assert "cannot reach amqp://127.0.0.1:5672/?exchange=secrets-test" in logs, logs[-3000:]
    forbidden = [*secrets.values(), whsec, base64.b64encode(raw_key).decode(), raw_key.decode()]
    for text in (logs, status.stdout, status.stderr, *scraped, *errors):
        for secret in forbidden:
            assert secret not in text, (secret, text[:3000])
    signed = receiver.requests[0].headers
    assert signed["webhook-signature"].startswith("v1,")  # the secret was used, not shown
