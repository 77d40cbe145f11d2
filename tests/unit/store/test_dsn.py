"""outbox.dsn: passwords never leave in clear text (pure)."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from outbox.store.dsn import for_child, redact, scrub, secrets_in_argv, secrets_of, with_net_timeouts


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:s3cret@db:5432/app",
        "host=db user=app password=s3cret dbname=app",
        "host=db password='s3cret' user=app",
    ],
)
def test_dsn_password_is_redacted(dsn: str) -> None:
    assert "s3cret" not in redact(dsn)
    assert secrets_of(dsn) == ["s3cret"]
    assert scrub(f"failed for {dsn}", secrets_of(dsn)).count("s3cret") == 0


@pytest.mark.parametrize(
    "dsn",
    [
        "host=db user=app password=s3cret sslpassword=k3ypass dbname=app",
        "postgresql://app:s3cret@db:5432/app?sslpassword=k3ypass&sslmode=require",
    ],
)
def test_the_tls_keys_passphrase_is_a_secret_too(dsn: str) -> None:
    assert "s3cret" not in redact(dsn) and "k3ypass" not in redact(dsn)
    assert sorted(secrets_of(dsn)) == ["k3ypass", "s3cret"]
    assert "k3ypass" not in redact(dsn + " '")  # unparsable: masked by pattern


def test_secret_settings_on_the_command_line_are_found() -> None:
    argv = ["relay", "--kafka-config", "sasl.password=hunter2", "--dsn", "postgresql://u:pw@h/db"]
    assert set(secrets_in_argv(argv)) == {"hunter2", "pw"}


def test_net_timeouts_are_added_where_the_dsn_is_silent_and_its_own_win() -> None:
    plain = conninfo_to_dict(with_net_timeouts("host=db dbname=app", 10))
    assert plain == {
        "host": "db",
        "dbname": "app",
        "connect_timeout": "10",
        "keepalives": "1",
        "keepalives_idle": "5",
        "keepalives_interval": "2",
        "keepalives_count": "2",
        "tcp_user_timeout": "10000",
    }
    own = conninfo_to_dict(
        with_net_timeouts("postgresql://app:pw@db/app?keepalives_idle=30&connect_timeout=3", 10)
    )
    assert (own["keepalives_idle"], own["connect_timeout"], own["password"]) == ("30", "3", "pw")
    assert own["tcp_user_timeout"] == "10000"
    assert (
        conninfo_to_dict(with_net_timeouts("", 20))["tcp_user_timeout"] == "20000"
    )  # libpq's PG* still apply


def test_a_child_process_gets_the_password_in_its_environment_not_on_its_command_line() -> None:
    """A command line is readable by every local user (ps): the embedded servers' generated
    password goes to the bench's relays and consoles as PGPASSWORD."""
    dsn, env = for_child("host=/tmp/pg user=postgres dbname=postgres password=s3cret")
    assert "s3cret" not in dsn and env == {"PGPASSWORD": "s3cret"}
    assert for_child("host=h dbname=d") == ("host=h dbname=d", {})
