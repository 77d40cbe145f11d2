"""outbox.dsn: passwords never leave in clear text (pure)."""

from __future__ import annotations

import pytest

from outbox.dsn import redact, scrub, secrets_in_argv, secrets_of


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


def test_secret_settings_on_the_command_line_are_found() -> None:
    argv = ["relay", "--kafka-config", "sasl.password=hunter2", "--dsn", "postgresql://u:pw@h/db"]
    assert set(secrets_in_argv(argv)) == {"hunter2", "pw"}
