"""tests.helpers.wait_for: a condition that cannot reach PostgreSQL once is polled again."""

from __future__ import annotations

import psycopg
import pytest

from tests.helpers import wait_for


def test_a_connection_error_is_polled_again() -> None:
    answers = iter([psycopg.OperationalError("connection timeout expired"), None, 7])

    def condition() -> int | None:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_for(condition, timeout=5, interval=0) == 7


def test_a_lasting_connection_error_fails_with_the_timeout_and_says_what_it_was() -> None:
    def condition() -> None:
        raise psycopg.OperationalError("connection refused")

    with pytest.raises(
        AssertionError, match=r"waiting for the server \(last: OperationalError: connection refused\)"
    ):
        wait_for(condition, timeout=0.05, interval=0.01, what="the server")


def test_other_errors_are_not_swallowed() -> None:
    def condition() -> None:
        raise psycopg.errors.UndefinedTable("no such table")

    with pytest.raises(psycopg.errors.UndefinedTable):
        wait_for(condition, timeout=1, interval=0)
