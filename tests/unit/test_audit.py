"""The audit trail's equivalent command lines (outbox.audit.command): pure logic."""

from __future__ import annotations

import shlex

from outbox.audit import command


def test_dead_letter_commands_carry_the_filters_quoted() -> None:
    cmd = command("redrive", {"key": "it's a key", "topic": "orders", "high_water": 9})
    assert cmd == "outbox dead redrive --key 'it'\"'\"'s a key' --topic orders --yes"
    assert shlex.split(cmd)[4] == "it's a key"


def test_no_filter_means_all_and_ids_are_listed() -> None:
    assert command("skip", {"high_water": 7}) == "outbox dead skip --all --yes"
    assert command("skip", {"ids": [3, 5], "high_water": 5}) == "outbox dead skip --ids 3 5 --yes"


def test_replay_and_purge() -> None:
    since, until = "2026-11-24T10:00:00+00:00", "2026-11-24T11:00:00+00:00"
    assert command("replay", {"since": since, "until": until, "key": "0xff00"}) == (
        f"outbox replay --since {since} --until {until} --key 0xff00 --yes"
    )
    assert command("purge", {"older_than": "30d", "cutoff": since}) == "outbox purge --older-than 30d --yes"
