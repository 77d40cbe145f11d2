"""Teams' own tools, for real, in their own processes: a Django project (``manage.py
makemigrations`` + ``migrate``, a management command that writes an order and its event),
an Alembic revision (``alembic upgrade head``), and an app's test suite using the pytest
plugin. Both migration paths must leave the same catalog as ``outbox migrate``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests.helpers import catalog
from tests.stacks import url


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


def _run(cmd: list[str], cwd: Path, env: dict[str, str], ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=180
    )
    if ok and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture
def database(pg_dsn: str) -> Iterator[str]:
    """A database of its own (Django keeps its migration records in ``public``)."""
    name = f"app_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield make_conninfo(pg_dsn, dbname=name)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _reference(dsn: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """The catalog ``outbox migrate`` makes, in a scratch schema of the same database."""
    from outbox.store.migrate import migrate

    other = f"ref_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, other)
        try:
            return {
                k: [tuple(v.replace(other, schema) if isinstance(v, str) else v for v in r) for r in rows]
                for k, rows in catalog(conn, other).items()
            }
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(other)))


DJANGO_PROJECT = {
    "manage.py": """
        import os, sys
        from django.core.management import execute_from_command_line
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")
        execute_from_command_line(sys.argv)
    """,
    "shopsite/__init__.py": "",
    "shopsite/settings.py": """
        import os
        from psycopg.conninfo import conninfo_to_dict
        p = conninfo_to_dict(os.environ["APP_DSN"])
        SECRET_KEY = "test"
        USE_TZ = True
        DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
        INSTALLED_APPS = ["outbox.contrib.django", "shop"]
        DATABASES = {"default": {
            "ENGINE": "django.db.backends.postgresql", "NAME": p["dbname"], "USER": p.get("user", "root"),
            "PASSWORD": p.get("password", ""), "HOST": p.get("host", "127.0.0.1"), "PORT": str(p.get("port", 5432)),
        }}
        OUTBOX_SCHEMA = os.environ["APP_SCHEMA"]
    """,
    "shop/__init__.py": "",
    "shop/models.py": """
        from django.db import models

        class Order(models.Model):
            sku = models.CharField(max_length=40)
    """,
    "shop/management/__init__.py": "",
    "shop/management/commands/__init__.py": "",
    "shop/management/commands/place_order.py": """
        from django.conf import settings
        from django.core.management.base import BaseCommand
        from django.db import connection, transaction

        import outbox
        from shop.models import Order

        class Command(BaseCommand):
            def add_arguments(self, parser):
                parser.add_argument("sku")
                parser.add_argument("--fail", action="store_true")

            def handle(self, sku, fail, **options):
                with transaction.atomic():
                    order = Order.objects.create(sku=sku)
                    outbox.enqueue(connection, "orders.created", {"order": order.id, "sku": sku},
                                   key=str(order.id), schema=settings.OUTBOX_SCHEMA)
                    if fail:
                        raise RuntimeError("payment declined")
                self.stdout.write(f"order {order.id}")
    """,
}


def test_django_project_migrates_the_outbox_and_commits_events_with_its_orders(
    tmp_path: Path, database: str
) -> None:
    _write(tmp_path, DJANGO_PROJECT)
    env = {"APP_DSN": database, "APP_SCHEMA": "shop_outbox"}
    py = sys.executable
    _run([py, "manage.py", "makemigrations", "shop"], tmp_path, env)
    migrated = _run([py, "manage.py", "migrate", "--no-input"], tmp_path, env).stdout
    assert "Applying outbox.0001_outbox_schema... OK" in migrated
    assert "order 1" in _run([py, "manage.py", "place_order", "a-1"], tmp_path, env).stdout
    failed = _run([py, "manage.py", "place_order", "b-2", "--fail"], tmp_path, env, ok=False)
    assert failed.returncode != 0 and "payment declined" in failed.stderr
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT id, sku FROM shop_order").fetchall() == [(1, "a-1")]
        events = conn.execute("SELECT topic, key, payload FROM shop_outbox.events").fetchall()
        assert events == [("orders.created", b"1", b'{"order":1,"sku":"a-1"}')]
        assert catalog(conn, "shop_outbox") == _reference(database, "shop_outbox")
    # `outbox migrate` agrees that nothing is missing.
    status = _run([py, "-m", "outbox", "migrate", "--dsn", database, "--schema", "shop_outbox"], tmp_path, {})
    assert "up to date" in status.stdout + status.stderr


ALEMBIC_PROJECT = {
    "alembic.ini": """
        [alembic]
        script_location = migrations
    """,
    "migrations/env.py": """
        import os
        from alembic import context
        from sqlalchemy import create_engine

        engine = create_engine(os.environ["APP_URL"])
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=None)
            with context.begin_transaction():
                context.run_migrations()
    """,
    "migrations/script.py.mako": "",
    "migrations/versions/0001_outbox.py": """
        import os
        from alembic import op
        from outbox.contrib.alembic import upgrade as outbox_upgrade

        revision = "0001"
        down_revision = None

        def upgrade():
            op.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, sku text NOT NULL)")
            outbox_upgrade(op, schema=os.environ["APP_SCHEMA"])

        def downgrade():
            pass
    """,
}


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_alembic_upgrade_applies_the_outbox_migrations(tmp_path: Path, database: str, driver: str) -> None:
    _write(tmp_path, ALEMBIC_PROJECT)
    env = {"APP_URL": url(database, driver), "APP_SCHEMA": "app_outbox"}
    _run([sys.executable, "-m", "alembic", "upgrade", "head"], tmp_path, env)
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("0001",)]
        assert catalog(conn, "app_outbox") == _reference(database, "app_outbox")
    from outbox.store.migrate import migrate

    with psycopg.connect(database, autocommit=True) as conn:
        assert migrate(conn, "app_outbox") == []  # outbox migrate sees every version applied


PLUGIN_APP = {
    "shop.py": """
        import outbox

        def checkout(session, sku, schema):
            '''An app's code: the order and its event in one transaction (SQLAlchemy).'''
            session.execute(__import__("sqlalchemy").text("SELECT 1"))
            outbox.enqueue(session, "orders.created", {"sku": sku}, key=sku, headers={"tenant": "t1"}, schema=schema)
            session.commit()
    """,
    "test_shop.py": """
        import os
        import pytest
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        from outbox.testing import assert_enqueued
        from shop import checkout

        @pytest.fixture
        def session():
            engine = create_engine(os.environ["APP_URL"])
            with Session(engine) as s:
                yield s
            engine.dispose()

        def test_checkout_enqueues_the_order(session, outbox_events):
            checkout(session, "a-1", os.environ["APP_SCHEMA"])
            event = outbox_events.assert_enqueued("orders.created", key="a-1", headers={"tenant": "t1"})
            assert event.payload == {"sku": "a-1"}
            assert event.headers["content-type"] == "application/json"
            assert_enqueued("orders.created", payload={"sku": "a-1"}, count=1)
            outbox_events.assert_nothing_enqueued("orders.cancelled")

        def test_a_missing_event_names_what_was_enqueued(session, outbox_events):
            checkout(session, "b-2", os.environ["APP_SCHEMA"])
            with pytest.raises(AssertionError) as failed:
                outbox_events.assert_enqueued("orders.cancelled")
            assert "expected an event with topic='orders.cancelled', found 0" in str(failed.value)
            assert "orders.created key='b-2'" in str(failed.value)
    """,
}


def test_pytest_plugin_in_an_apps_own_tests(tmp_path: Path, pg_dsn: str, schema: str) -> None:
    _write(tmp_path, PLUGIN_APP)
    env = {"APP_URL": url(pg_dsn, "psycopg"), "APP_SCHEMA": schema, "PYTHONPATH": str(tmp_path)}
    done = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_shop.py"], tmp_path, env
    )
    assert "2 passed" in done.stdout, done.stdout
    with psycopg.connect(pg_dsn) as conn:  # the app's transactions committed for real
        rows = conn.execute(
            sql.SQL("SELECT key FROM {}.events ORDER BY id").format(sql.Identifier(schema))
        ).fetchall()
    assert rows == [(b"a-1",), (b"b-2",)]


def test_the_django_app_without_django_names_the_extra() -> None:
    code = (
        "import sys\n"
        "class _Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'django':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Missing())\n"
        "try:\n"
        "    import outbox.contrib.django\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout == "outbox.contrib.django needs: pip install 'outbox-relay[django]'\n", out.stderr


def test_the_pytest_plugin_loads_in_every_run_and_p_no_outbox_leaves_it_out(tmp_path: Path) -> None:
    (tmp_path / "test_uses_it.py").write_text(
        "def test_fixture(outbox_events):\n    outbox_events.assert_nothing_enqueued('orders.created')\n"
    )
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)]
    loaded = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stdout[-2000:]
    left_out = subprocess.run(
        [*run, "-p", "no:outbox"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert left_out.returncode == 1 and "fixture 'outbox_events' not found" in left_out.stdout, (
        left_out.stdout[-2000:]
    )
