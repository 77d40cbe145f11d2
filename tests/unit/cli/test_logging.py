"""The relay's log setup: the JSON lines' structured fields, and the libraries' per-request INFO
lines kept out."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from outbox.cli import JsonFormatter, setup_logging


@pytest.fixture
def restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in ("httpx", "httpx2", "botocore.credentials")}
    yield
    root.handlers[:], root.level = handlers, level
    for name, was in quiet.items():
        logging.getLogger(name).setLevel(was)


def test_a_json_line_keeps_event_outbox_and_batch_age_and_nothing_else_of_extra() -> None:
    record = logging.LogRecord(
        "outbox.relay", logging.WARNING, __file__, 0, "ack of %d events refused", (3,), None
    )
    record.__dict__.update(
        event="lease.lost", outbox="tenant_a", batch_age=5.668, dsn="postgresql://u:pw@h/db"
    )
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "ack of 3 events refused"
    assert (line["event"], line["outbox"], line["batch_age"]) == ("lease.lost", "tenant_a", 5.668)
    assert "dsn" not in line  # an extra the formatter does not know stays out


def test_per_request_info_lines_of_http_clients_are_kept_out_at_info(restored: None) -> None:
    setup_logging("text", "info")
    for name in ("httpx", "httpx2", "botocore.credentials"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger(name).isEnabledFor(logging.WARNING), name
    assert logging.getLogger("outbox.relay").isEnabledFor(logging.INFO)
