"""outbox.cli.options: every option comes from its setting; flags, variables and defaults agree (pure)."""

from __future__ import annotations

import dataclasses
from importlib.metadata import entry_points
from typing import Any

import pytest

from outbox.cli import build_parser, options
from outbox.cli.relay import relay_config
from outbox.errors import ConfigError
from outbox.relay.config import RelayConfig
from outbox.relay.retry import RetryPolicy


def _relay_args(*argv: str) -> Any:
    return build_parser().parse_args(["relay", "--kafka-bootstrap", "k:1", *argv])


def test_relay_defaults_are_the_configs_defaults() -> None:
    built = relay_config(_relay_args())
    plain = RelayConfig("")
    for f in dataclasses.fields(RelayConfig):
        if f.name not in ("dsn", "name"):
            assert getattr(built, f.name) == getattr(plain, f.name), f.name
    assert built.retry == RetryPolicy()


def test_every_relay_setting_is_a_flag_with_its_variable_in_the_help() -> None:
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["relay"].format_help().split())  # type: ignore[union-attr]
    for cls in (RelayConfig, RetryPolicy):
        for option in options.options_of(cls):
            assert option.flag in help_text and option.env in help_text, option.name


def test_flags_win_over_variables_which_win_over_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "300")
    monkeypatch.setenv("OUTBOX_NOTIFY", "off")
    monkeypatch.setenv("OUTBOX_RETRY_BASE", "0.5")
    config = relay_config(_relay_args("--batch-size", "400"))
    assert config.batch_size == 400 and config.notify is False and config.retry.base == 0.5


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("OUTBOX_BATCH_SIZE", "many", "OUTBOX_BATCH_SIZE: expected an integer"),
        ("OUTBOX_LEASE", "soon", "OUTBOX_LEASE: expected a number"),
        ("OUTBOX_ARCHIVE", "perhaps", "OUTBOX_ARCHIVE: expected true/false"),
        ("OUTBOX_ORDERING", "random", "OUTBOX_ORDERING: must be one of key, none"),
    ],
)
def test_bad_variables_are_named(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        build_parser()


def test_invalid_combinations_are_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="delivery timeout"):
        relay_config(_relay_args("--lease", "5", "--delivery-timeout", "6"))


def test_metrics_port_zero_means_off_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    assert relay_config(_relay_args("--metrics-port", "0")).metrics_port is None
    monkeypatch.setenv("OUTBOX_METRICS_PORT", "9464")
    assert relay_config(_relay_args()).metrics_port == 9464


def test_every_command_is_in_groups_and_its_group_alone_builds_it() -> None:
    from outbox.cli import GROUPS, PLUGINS

    every = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(every) == set(GROUPS) | set(PLUGINS)
    for command in every:
        alone = build_parser(command=command)._subparsers._group_actions[0].choices  # type: ignore[union-attr]
        assert (command in alone and len(alone) < len(every)) or command in PLUGINS, command


def test_the_bench_is_another_distributions_command_and_only_its_own_command_loads_it() -> None:
    """`outbox bench` comes from outbox-relay-bench's entry point (installed here, from
    benchmarks/); any other command line lists it by its help line and imports none of it."""
    from outbox.cli import ENTRY_POINTS, PLUGINS

    [entry] = entry_points(group=ENTRY_POINTS, name="bench")
    assert entry.value == "outbox_bench.cli:register" and entry.dist is not None
    assert entry.dist.name == "outbox-relay-bench" and "bench" in PLUGINS
    listed = build_parser(bench=False)._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert listed["bench"].format_usage().strip() == "usage: outbox bench"
    loaded = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert "--scenarios" in loaded["bench"].format_help()


def test_outbox_dev_refuses_a_taken_port_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The quickstart's servers on a machine that has its own PostgreSQL on 5432: one line naming
    the option to change, before anything starts."""
    import socket

    from outbox.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["dev", "--pg-port", str(port), "--kafka-port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert f"--pg-port: port {port} is taken" in err and "Traceback" not in err
