"""Limits and weights: parsing, globs as PostgreSQL regular expressions, the throttled time."""

from __future__ import annotations

import re

import pytest

from outbox.errors import ConfigError
from outbox.relay.limits import Gate, either, gates, glob_regex, parse_limit, parse_weights, weight_of

TOPICS = ["partner.orders", "partner.x.y", "partnerX", "orders", "a-b_c", "a.b", "a?b", "[x]", "p1", "p"]
GLOBS = ["partner.*", "*", "orders", "a-b_?", "a?b", "[ab].b", "[!a]*", "p?", "*.y", "a.b"]


@pytest.mark.parametrize("glob", GLOBS)
def test_a_glob_as_a_regular_expression_matches_what_fnmatch_matches(glob: str) -> None:
    from fnmatch import fnmatchcase

    pattern = re.compile(glob_regex(glob))
    for topic in TOPICS:
        assert bool(pattern.search(topic)) == fnmatchcase(topic, glob), (glob, topic)


def test_a_topic_belongs_to_the_first_limit_that_matches_it() -> None:
    first, second = gates([parse_limit("partner.*=5/s"), parse_limit("*=in_flight=2")])
    assert first.skip is None and second.skip == either(["partner.*"])
    assert re.search(second.only, "partner.orders") and re.search(str(second.skip), "partner.orders")


def test_a_limit_spec_is_a_rate_and_or_a_cap() -> None:
    limit = parse_limit("partner.*=50/s,in_flight=8")
    assert (limit.rate, limit.in_flight, limit.burst, limit.least) == (50.0, 8, 50.0, 5)
    assert parse_limit("q=in_flight=2").rate is None and parse_limit("q=in_flight=2").burst == 1.0
    assert parse_limit("q=0.5/s").least == 1
    with pytest.raises(ConfigError, match="--limit 'q=5'"):
        parse_limit("q=5")


def test_weights_are_the_first_matching_glob_or_one() -> None:
    weights = parse_weights(["gold-*=3 silver-*=2", "gold-x=9"])
    assert [weight_of(weights, n) for n in ("gold-x", "silver-a", "bronze")] == [3, 2, 1]


def test_the_throttled_time_counts_from_the_first_refusal_to_the_tokens() -> None:
    gate = Gate(parse_limit("p=5/s"), "^p$", None)
    assert gate.throttle(10.0, 10.2) == 0.0 and gate.next_try == 10.2
    assert gate.throttle(10.2, 10.4) == pytest.approx(0.2)
    assert gate.flowing(10.5) == pytest.approx(0.3)
    assert gate.flowing(11.0) == 0.0  # not throttled: nothing counted
