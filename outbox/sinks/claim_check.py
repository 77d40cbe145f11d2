"""Claim-check: payloads too big for a broker travel by reference.

``outbox relay --claim-check-over BYTES --claim-check-store URL``: a payload over the
threshold is written to the store and confirmed **before** its message is produced; the
message then carries the header ``outbox-claim-check: <reference>`` and an empty body, its
other headers unchanged. A store that fails makes the event retry (kind
``claim_check_store``), never dead-letter. Per-key order is kept: the store is written in
the relay's produce order, and a failure holds the key's later events like any failure.

Stores:

- ``postgres:`` — the ``claim_checks`` table of the outbox schema (migration 0007).
  Reference ``postgres:<schema>/<event id>``. For consumers that can reach that database.
- ``s3://bucket/prefix?endpoint=URL&region=R`` — an S3-compatible object store (boto3,
  ``outbox-relay[s3]``). Object ``<prefix>/<YYYYMMDD>/<event id>`` (the day it was stored, UTC);
  reference ``s3://bucket/<key>``. Credentials come from boto3's usual chain
  (``AWS_ACCESS_KEY_ID`` … or a role), never from the URL.

Retention: ``outbox purge --older-than D`` deletes stored payloads older than its cutoff
with the archive partitions of those days. Consumers resolve references with
:func:`fetch` (``outbox.inbox.consume_kafka`` does it before the handler sees a message).

A reference arrives in a message, and whoever can produce to the topic chooses it: a consumer
follows one only into the store it names itself (``store=``: ``postgres:<schema>`` or
``s3://bucket/prefix``), never into another schema, bucket or prefix that its own credentials
could read. A reference that is malformed or points elsewhere raises :class:`ClaimCheckRefused`.
The header itself is the relay's: ``enqueue`` refuses a writer's copy.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import psycopg

from outbox.errors import ClaimCheckRefused, ConfigError, StoreUnavailable
from outbox.events import CLAIM_CHECK_HEADER, ClaimedEvent
from outbox.sinks.base import Outcome, Report, Retry, Sink, SinkWrapper
from outbox.store.dsn import redact, scrub, secrets_of
from outbox.store.queries import query
from outbox.store.schema import DEFAULT_SCHEMA, validate_schema

log = logging.getLogger("outbox.claim_check")

HEADER = CLAIM_CHECK_HEADER
PURGE_CHUNK = 1000
S3_OPTIONS = ("endpoint", "region")


class Store(Protocol):
    name: str  # for logs and errors: never holds credentials

    def put(self, event_id: str, payload: bytes) -> str: ...
    def get(self, reference: str) -> bytes: ...
    def purge(self, cutoff: dt.datetime) -> int: ...
    def held(self) -> tuple[int, int]: ...
    def close(self) -> None: ...


class PostgresStore:
    """Payloads in ``<schema>.claim_checks``, over a connection of its own (autocommit)."""

    def __init__(self, dsn: str, schema: str = DEFAULT_SCHEMA) -> None:
        self._dsn = dsn
        self.schema = validate_schema(schema)
        self.name = f"postgres:{self.schema}"
        self._conn: psycopg.Connection[Any] | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            try:
                # Not pinned (outbox.pinning): a consumer's fetch may go through a transaction
                # pooler; the store's statements name pg_catalog's functions in full.
                self._conn = psycopg.connect(
                    self._dsn, autocommit=True, application_name="outbox-claim-check"
                )
            except psycopg.OperationalError as exc:
                why = scrub(_first_line(exc), secrets_of(self._dsn))
                raise StoreUnavailable(f"cannot connect to {redact(self._dsn)}: {why}") from None
        return self._conn

    def _run(self, name: str, params: Any) -> psycopg.Cursor[Any]:
        conn = self._connection()
        try:
            return conn.execute(query(name, self.schema), params)
        except psycopg.OperationalError as exc:
            conn.close()
            raise StoreUnavailable(scrub(_first_line(exc), secrets_of(self._dsn))) from None
        except psycopg.errors.UndefinedTable:
            raise ConfigError(
                f"--claim-check-store: schema {self.schema!r} has no claim_checks table; run `outbox migrate`"
            ) from None

    def put(self, event_id: str, payload: bytes) -> str:
        self._run("claim_check_put", (event_id, payload))
        return f"postgres:{self.schema}/{event_id}"

    def get(self, reference: str) -> bytes:
        schema, event_id = _postgres_reference(reference)
        if schema != self.schema:
            raise ClaimCheckRefused(
                f"reference: points into schema {schema[:63]!r}, this store reads {self.schema!r}"
            )
        row = self._run("claim_check_get", (event_id,)).fetchone()
        if row is None:
            raise LookupError(f"reference: {reference!r} is not in the store (purged?)")
        return bytes(row[0])

    def purge(self, cutoff: dt.datetime) -> int:
        deleted = 0
        while True:
            n = self._run("claim_check_purge_chunk", {"cutoff": cutoff, "limit": PURGE_CHUNK}).rowcount
            deleted += max(n, 0)
            if n < PURGE_CHUNK:
                return deleted

    def held(self) -> tuple[int, int]:
        row = self._run("claim_check_held", None).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class S3Store:
    """Payloads as objects in an S3-compatible store (boto3)."""

    def __init__(self, url: str) -> None:
        from outbox.extras import require

        require("s3", "--claim-check-store s3://")
        import boto3
        from botocore.config import Config

        parts = urlsplit(url)
        if parts.username or parts.password:
            raise ConfigError(
                "--claim-check-store: put no credentials in the URL; boto3 takes them from "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the instance's role"
            )
        if not parts.hostname:
            raise ConfigError("--claim-check-store: s3://BUCKET[/PREFIX][?endpoint=URL&region=R]")
        options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = sorted(set(options) - set(S3_OPTIONS))
        if unknown:
            raise ConfigError(
                f"--claim-check-store: unknown option {unknown[0]!r}; known: {', '.join(S3_OPTIONS)}"
            )
        self.bucket = parts.hostname
        self.prefix = parts.path.strip("/")
        self.name = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self._client = boto3.client(
            "s3",
            endpoint_url=options.get("endpoint"),
            region_name=options.get("region"),
            # Fail fast and let the relay's persisted backoff retry, rather than block the loop.
            config=Config(connect_timeout=3, read_timeout=30, retries={"max_attempts": 1}),
        )

    def _key(self, event_id: str, day: dt.date) -> str:
        name = f"{day:%Y%m%d}/{event_id}"
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404"):
                raise LookupError(f"{what}: not in the store (purged?)") from None
            if code in ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StoreUnavailable(f"{self.name}: {code}") from None  # retried: an operator can fix it
            raise StoreUnavailable(f"{self.name}: {code or exc}") from None
        except BotoCoreError as exc:
            raise StoreUnavailable(f"{self.name}: {type(exc).__name__}") from None

    def put(self, event_id: str, payload: bytes) -> str:
        key = self._key(event_id, dt.datetime.now(dt.timezone.utc).date())
        self._call("put", lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=payload))
        return f"s3://{self.bucket}/{key}"

    def get(self, reference: str) -> bytes:
        bucket, key = _s3_reference(reference)
        body = self._call(reference, lambda: self._client.get_object(Bucket=bucket, Key=key)["Body"])
        return bytes(self._call(reference, body.read))

    def _days(self) -> list[tuple[str, dt.date]]:
        """(listing prefix, day) of each day folder under the prefix."""
        base = f"{self.prefix}/" if self.prefix else ""
        out = []
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base, Delimiter="/"
        )
        for page in self._call("list", lambda: list(pages)):
            for common in page.get("CommonPrefixes", []):
                folder = common["Prefix"][len(base) :].strip("/")
                try:
                    out.append((common["Prefix"], dt.datetime.strptime(folder, "%Y%m%d").date()))
                except ValueError:
                    continue  # not ours
        return out

    def _objects(self, prefix: str) -> list[dict[str, Any]]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o for page in self._call("list", lambda: list(pages)) for o in page.get("Contents", [])]

    def purge(self, cutoff: dt.datetime) -> int:
        deleted = 0
        for prefix, day in self._days():
            day_ends = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), tzinfo=dt.timezone.utc)
            if day_ends > cutoff:
                continue  # a day goes only once all of it is older than the cutoff (as the archive's)
            keys = [o["Key"] for o in self._objects(prefix)]
            for i in range(0, len(keys), 1000):
                deleted += self._delete(keys[i : i + 1000])
        return deleted

    def _delete(self, keys: list[str]) -> int:
        objects = [{"Key": k} for k in keys]
        self._call(
            "delete", lambda: self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects})
        )
        return len(objects)

    def held(self) -> tuple[int, int]:
        base = f"{self.prefix}/" if self.prefix else ""
        objects = self._objects(base)
        return len(objects), sum(int(o.get("Size", 0)) for o in objects)

    def close(self) -> None:
        self._client.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _shown(reference: str) -> str:
    return repr(reference[:120])  # a reference is a message's: shown short


def _postgres_reference(reference: str) -> tuple[str, str]:
    schema, sep, event_id = reference[len("postgres:") :].partition("/")
    if not reference.startswith("postgres:") or not sep or not schema or not _is_uuid(event_id):
        raise ClaimCheckRefused(f"reference: expected postgres:<schema>/<event id>, got {_shown(reference)}")
    return schema, event_id


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text
    except ValueError:
        return False


def _s3_reference(reference: str) -> tuple[str, str]:
    try:
        parts = urlsplit(reference)
    except ValueError:
        parts = urlsplit("")
    key = parts.path.lstrip("/")
    if parts.scheme != "s3" or not parts.hostname or not key or parts.query or parts.fragment:
        raise ClaimCheckRefused(f"reference: expected s3://<bucket>/<key>, got {_shown(reference)}")
    return parts.netloc, key


def _within(reference: str, store: str) -> None:
    """ClaimCheckRefused unless ``reference`` is well formed and points into ``store``
    (``postgres:<schema>``, or ``s3://bucket[/prefix]``)."""
    if store.startswith("postgres:"):
        schema, _ = _postgres_reference(reference) if reference.startswith("postgres:") else ("", "")
        if schema != store[len("postgres:") :]:
            raise ClaimCheckRefused(f"reference: {_shown(reference)} is not in the store {store}")
        return
    bucket, _, prefix = store[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not reference.startswith("s3://"):
        raise ClaimCheckRefused(f"reference: {_shown(reference)} is not in the store {store}")
    got_bucket, key = _s3_reference(reference)
    segments = key.split("/")
    if (
        got_bucket != bucket
        or (prefix and not key.startswith(prefix + "/"))
        or any(s in ("", ".", "..") for s in segments)
    ):
        raise ClaimCheckRefused(f"reference: {_shown(reference)} is not in the store {store}")


def open_store(url: str, *, dsn: str | None = None, schema: str = DEFAULT_SCHEMA) -> Store:
    """The store of a ``--claim-check-store`` URL: ``postgres:`` (on ``dsn``) or ``s3://…``."""
    if url in ("postgres:", "postgres", "postgresql:"):
        if dsn is None:
            raise ConfigError("--claim-check-store: postgres: needs the outbox's --dsn")
        return PostgresStore(dsn, schema)
    if url.startswith("s3://"):
        return S3Store(url)
    raise ConfigError(
        f"--claim-check-store: expected postgres: or s3://BUCKET/PREFIX, got {url.split('?')[0]!r}"
    )


def fetch(
    reference: str | bytes,
    *,
    store: str = "postgres:" + DEFAULT_SCHEMA,
    dsn: str | None = None,
    endpoint: str | None = None,
) -> bytes:
    """The payload a ``outbox-claim-check`` header refers to, from ``store`` only.

    ``store``: where this consumer's references may point, as the relay's
    ``--claim-check-store`` names it: ``postgres:<schema>`` (read through ``dsn``, the outbox's
    database) or ``s3://bucket[/prefix]`` (boto3's credentials, from ``endpoint``, else
    boto3's, e.g. AWS_ENDPOINT_URL). ClaimCheckRefused if the reference is malformed or points
    anywhere else; LookupError if it is gone (purged); StoreUnavailable if the store cannot
    answer now.
    """
    try:
        ref = reference.decode() if isinstance(reference, bytes) else reference
    except UnicodeDecodeError:
        raise ClaimCheckRefused("reference: not UTF-8 text") from None
    if not (store.startswith("postgres:") and store[len("postgres:") :]) and not store.startswith("s3://"):
        raise ConfigError(f"store: expected postgres:<schema> or s3://bucket[/prefix], got {store!r}")
    _within(ref, store)
    if store.startswith("postgres:"):
        if dsn is None:
            raise ConfigError("dsn: a postgres: reference is read from the outbox's database; pass dsn=")
        opened: Store = PostgresStore(dsn, store[len("postgres:") :])
    else:
        bucket, _ = _s3_reference(ref)
        opened = S3Store(f"s3://{bucket}" + (f"?endpoint={endpoint}" if endpoint else ""))
    try:
        return opened.get(ref)
    finally:
        opened.close()


class ClaimCheckSink(SinkWrapper):
    """Stores payloads over ``over`` bytes in ``store`` and sends the reference instead."""

    def __init__(self, inner: Sink, store: Store, over: int) -> None:
        super().__init__(inner)
        self.store = store
        self.over = over

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        if len(event.payload) <= self.over:
            return self.inner.produce(event, report)
        try:
            reference = self.store.put(event.event_id, event.payload)
        except StoreUnavailable as exc:
            return Retry("claim_check_store", f"claim-check store {self.store.name}: {exc}")
        headers = [*event.headers, (HEADER, reference.encode())]
        return self.inner.produce(event._replace(payload=b"", headers=headers), report)
