"""The audit trail's equivalent command lines (outbox.audit.command): pure logic."""

from __future__ import annotations

import shlex

from outbox.operate.audit import command


def test_dead_letter_commands_carry_the_filters_quoted() -> None:
    cmd = command("redrive", {"key": "it's a key", "topic": "orders", "high_water": 9})
    assert cmd == "outbox dead redrive --key 'it'\"'\"'s a key' --topic orders --high-water 9 --yes"
    assert shlex.split(cmd)[4] == "it's a key"


def test_every_console_filter_is_on_the_command_line() -> None:
    """The console's error, fingerprint and time filters and its page's mark: left out, the
    command acted on far more than the console did."""
    since, until = "2026-11-24T10:00:00+00:00", "2026-11-24T11:00:00+00:00"
    chosen = {"error": "Denied", "fingerprint": "x: <n>", "since": since, "until": until, "high_water": 4}
    assert shlex.split(command("skip", chosen)) == [
        "outbox", "dead", "skip", "--error", "Denied", "--fingerprint", "x: <n>", "--since", since,
        "--until", until, "--high-water", "4", "--yes",
    ]  # fmt: skip


def test_no_filter_means_all_and_ids_are_listed() -> None:
    assert command("skip", {"high_water": 7}) == "outbox dead skip --all --high-water 7 --yes"
    assert (
        command("skip", {"ids": [3, 5], "high_water": 5}) == "outbox dead skip --ids 3 5 --high-water 5 --yes"
    )
    assert command("skip", {"topic": "t"}) == "outbox dead skip --topic t --yes"


def test_replay_and_purge() -> None:
    since, until = "2026-11-24T10:00:00+00:00", "2026-11-24T11:00:00+00:00"
    assert command("replay", {"since": since, "until": until, "key": "0xff00", "upto": 41}) == (
        f"outbox replay --since {since} --until {until} --key 0xff00 --upto 41 --yes"
    )
    assert command("purge", {"older_than": "30d", "cutoff": since}) == "outbox purge --older-than 30d --yes"
