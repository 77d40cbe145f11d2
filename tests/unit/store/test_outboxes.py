"""NAME=DSN[#SCHEMA] specs, the outboxes file, and what makes two outboxes the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox.errors import ConfigError
from outbox.store.outboxes import Outbox, parse_outbox, read_outboxes_file, unique


def test_a_spec_names_a_dsn_and_a_schema() -> None:
    assert parse_outbox("orders=postgresql://app:pw@db:5432/shop#tenant_7") == Outbox(
        "orders", "postgresql://app:pw@db:5432/shop", "tenant_7"
    )
    assert parse_outbox("billing=host=db dbname=bill").schema == "outbox"  # the default schema
    assert parse_outbox("b=host=db dbname=bill#").schema == "outbox"


def test_a_hash_inside_a_quoted_password_is_not_the_schema() -> None:
    o = parse_outbox("x=host=db password='a#b' dbname=d#s1")
    assert (o.dsn, o.schema) == ("host=db password='a#b' dbname=d", "s1")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("postgresql://db/shop", "expected NAME=DSN[#SCHEMA]"),
        ("orders=", "expected NAME=DSN[#SCHEMA]"),
        ("has space=host=db", "outbox name 'has space'"),
        ("-x=host=db", "outbox name '-x'"),
        ("x=host=db#pg_catalog", "schema: 'pg_catalog' is reserved"),
        ("x=nonsense without equals", "the DSN is not a valid connection string"),
    ],
)
def test_bad_specs_are_one_line_naming_the_field(spec: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_outbox(spec)
    assert str(err.value).startswith("--outbox: ") and says in str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_spec_never_echoes_the_password() -> None:
    with pytest.raises(ConfigError) as err:
        parse_outbox("bad name=postgresql://app:s3cret@db/shop")
    assert "s3cret" not in str(err.value)
    assert "s3cret" not in parse_outbox("ok=postgresql://app:s3cret@db/shop#t").display


def test_the_file_skips_comments_and_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "outboxes"
    path.write_text("# tenants\n\na=host=db1 dbname=a#s\n  b=host=db2 dbname=b  \n")
    assert [o.name for o in read_outboxes_file(path)] == ["a", "b"]
    path.write_text("a=host=db1\nnot a spec\n")
    with pytest.raises(ConfigError, match=rf"^--outboxes-file {path}:2: expected NAME=DSN"):
        read_outboxes_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_outboxes_file(tmp_path / "absent")


def test_two_outboxes_may_not_share_a_name_or_a_schema_of_one_database() -> None:
    a = parse_outbox("a=host=db dbname=shop password=x#s")
    with pytest.raises(ConfigError, match="the name 'a' is given twice"):
        unique([a, parse_outbox("a=host=db dbname=other#s")])
    # The same database whatever the password says: one schema, two names.
    with pytest.raises(ConfigError, match="'a' and 'b' are the same schema 's'"):
        unique([a, parse_outbox("b=host=db dbname=shop password=y#s")])
    assert [o.name for o in unique([a, parse_outbox("b=host=db dbname=shop#t")])] == ["a", "b"]
