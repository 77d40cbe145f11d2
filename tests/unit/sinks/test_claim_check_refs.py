"""Which claim-check references a consumer follows (outbox.claim_check): pure logic. A reference
is chosen by whoever can produce to the topic; the consumer follows it only into its own store."""

from __future__ import annotations

import pytest

from outbox.sinks.claim_check import ClaimCheckRefused, _within

ID = "3f1c9a52-7d6e-4b8a-9c21-5e0f4a7b8d13"  # fixed: parameter ids must be the same on every xdist worker


@pytest.mark.parametrize(
    "reference",
    [f"s3://payloads/outbox/20261127/{ID}", f"s3://payloads/outbox/{ID}"],
)
def test_a_reference_into_the_store_is_followed(reference: str) -> None:
    _within(reference, "s3://payloads/outbox")


@pytest.mark.parametrize(
    "reference",
    [
        f"s3://someone-else/outbox/20261127/{ID}",  # another bucket
        f"s3://payloads/outboxes/{ID}",  # a prefix that only starts the same
        f"s3://payloads/outbox/../secrets/{ID}",  # out of the prefix by a dot segment
        f"s3://payloads/outbox//{ID}",
        f"s3://user@payloads/outbox/{ID}",  # credentials, or a bucket spelled another way
        f"s3://payloads/outbox/{ID}?versionId=1",
        f"postgres:outbox/{ID}",  # another kind of store
        "s3://payloads",
        "",
    ],
)
def test_a_reference_elsewhere_or_malformed_is_refused(reference: str) -> None:
    with pytest.raises(ClaimCheckRefused):
        _within(reference, "s3://payloads/outbox")


def test_a_postgres_reference_only_into_the_named_schema_and_with_an_event_id() -> None:
    _within(f"postgres:tenant_a/{ID}", "postgres:tenant_a")
    for reference in (
        f"postgres:tenant_b/{ID}",
        "postgres:tenant_a/not-an-id",
        "postgres:",
        f"s3://tenant_a/{ID}",
    ):
        with pytest.raises(ClaimCheckRefused):
            _within(reference, "postgres:tenant_a")
