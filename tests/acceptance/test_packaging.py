"""The release, as a user gets it: the sdist and the wheel built with ``python -m build``, their
metadata read by ``twine check --strict``, and the wheel (not the source tree) installed with
extras into a fresh virtualenv, where the README's quickstart runs from nothing to a consumed
event and the console answers. Nothing of the source tree is on that virtualenv's path."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.bench.writers import sqlalchemy_url as url
from outbox.harness.infra import create_topic

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
EXAMPLE = re.compile(r"<!-- example: (\w+) -->\n```python\n(.*?)```", re.DOTALL)
EXTRAS = "console,aws,nats,sqlalchemy"
ORDERS = 300  # placed through the app, relayed, consumed

pytestmark = pytest.mark.timeout(600)


def _run(*args: str | Path, timeout: float = 300, **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done  # type: ignore[no-any-return]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), 1):
        return True


def _wait_for(what: str, check: object, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():  # type: ignore[operator]
                return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def _database(pg_dsn: str) -> Iterator[str]:
    """A database of its own: the quickstart's outbox lives in the default schema, ``outbox``."""
    name = f"qs_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield url(pg_dsn, "").rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@contextlib.contextmanager
def _process(
    *args: str | Path, env: dict[str, str], cwd: Path, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(a) for a in args], env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _count(dsn: str, query: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def test_the_release_installs_from_its_wheel_and_the_quickstart_runs(
    pg_dsn: str, kafka: str, tmp_path: Path
) -> None:
    # The sdist, then the wheel built from it (python -m build's default): what the sdist forgot,
    # the wheel misses.
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--outdir", dist, ROOT, timeout=400)
    [wheel] = dist.glob("outbox_relay-*.whl")
    [sdist] = dist.glob("outbox_relay-*.tar.gz")
    assert wheel.name == f"outbox_relay-{outbox.__version__}-py3-none-any.whl"
    _run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist)

    names = set(zipfile.ZipFile(wheel).namelist())
    info = f"outbox_relay-{outbox.__version__}.dist-info"
    for shipped in (
        "outbox/py.typed",
        "outbox/store/sql/relay.sql",
        "outbox/migrations/0001_initial.sql",
        "outbox/migrations/0018_fleet.sql",
        "outbox/migrations/roles.sql",
        "outbox/console/templates/base.html",
        "outbox/console/static/console.css",
        "outbox/console/static/vendor/htmx-2.0.11/htmx.min.js",
        "outbox/console/static/vendor/htmx-2.0.11/LICENSE",
        f"{info}/licenses/LICENSE",
        f"{info}/entry_points.txt",
    ):
        assert shipped in names, shipped
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "docs/"))]
    assert {n.split("/")[0] for n in names} == {"outbox", info}
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "outbox").rglob("__init__.py")}
    assert packages <= {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    for line in ("Name: outbox-relay", f"Version: {outbox.__version__}", "License-Expression: Apache-2.0"):
        assert line in metadata.splitlines(), line
    assert (
        "Provides-Extra: console" in metadata
        and "Classifier: Programming Language :: Python :: 3.13" in metadata
    )

    # A fresh virtualenv, the wheel with extras and the quickstart's own packages, nothing else.
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "uv", "venv", "--quiet", "--python", sys.executable, venv)
    python, bin_ = venv / "bin" / "python", venv / "bin"
    _run(
        sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", python,
        f"outbox-relay[{EXTRAS}] @ {wheel.as_uri()}", "fastapi", timeout=400,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{bin_}:{env['PATH']}"
    version = _run(bin_ / "outbox", "--version", env=env, cwd=tmp_path)
    assert version.stdout.strip() == f"outbox {outbox.__version__}"
    where = _run(python, "-c", "import outbox; print(outbox.__file__)", env=env, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(venv)), where.stdout

    with _database(pg_dsn) as database:
        env |= {"DATABASE_URL": database, "KAFKA_BOOTSTRAP": kafka}
        _quickstart(env, bin_, tmp_path, database, kafka)
        _console_answers(env, bin_, tmp_path, database)


def _quickstart(env: dict[str, str], bin_: Path, tmp_path: Path, database: str, kafka: str) -> None:
    """The README's quickstart, its shell lines and its programs as written there."""
    [shell] = re.findall(r"```sh\n(pip install 'outbox-relay\[sqlalchemy\]'.*?)```", README, re.DOTALL)
    # Its first line installs what the virtualenv has already; the rest runs as written.
    lines = shell.splitlines()
    assert lines[0].startswith("pip install")
    setup = "\n".join(line for line in lines[1:] if not line.startswith("export "))
    _run("bash", "-euo", "pipefail", "-c", setup, env=env, cwd=tmp_path)
    programs = dict(EXAMPLE.findall(README))
    (tmp_path / "app.py").write_text(programs["app"])
    (tmp_path / "consumer.py").write_text(programs["consumer"])
    create_topic(kafka, "orders.placed", 1)

    port = _free_port()
    with _process(
        bin_ / "uvicorn", "app:app", "--port", str(port), env=env, cwd=tmp_path, log=tmp_path / "app.log"
    ):
        _wait_for("the app", lambda: _listening(port))
        for n in range(ORDERS):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/orders/sku-{n}", method="POST")
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert json.loads(answer.read())["order"]
    assert _count(database, "SELECT count(*) FROM outbox.events") == ORDERS

    relay = re.search(r"^outbox relay .*$", README, re.MULTILINE)
    assert relay is not None
    with _process(
        "bash", "-c", f"exec {relay.group(0)}", env=env, cwd=tmp_path, log=tmp_path / "relay.log"
    ) as proc:
        _wait_for(
            "the relay's drain", lambda: _count(database, "SELECT count(*) FROM outbox.delivered") == ORDERS
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "relay.log").read_text()[-3000:]
    assert _count(database, "SELECT count(*) FROM outbox.events") == 0

    with _process(
        bin_ / "python", "consumer.py", env=env, cwd=tmp_path, log=tmp_path / "consumer.log"
    ) as proc:
        _wait_for("the consumer", lambda: _count(database, "SELECT count(*) FROM shipments") == ORDERS, 120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "consumer.log").read_text()[-3000:]
    assert _count(database, "SELECT count(*) FROM outbox.inbox") == ORDERS
    assert "Traceback" not in (tmp_path / "consumer.log").read_text()


def _console_answers(env: dict[str, str], bin_: Path, tmp_path: Path, database: str) -> None:
    port = _free_port()
    args = (bin_ / "outbox", "console", "--dsn", database, "--port", str(port), "--read-only")
    with _process(*args, env=env, cwd=tmp_path, log=tmp_path / "console.log"):
        page = ""

        def overview() -> bool:
            nonlocal page
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as answer:
                page = answer.read().decode()
                return bool(answer.status == 200)

        _wait_for("the console's overview", overview)
    assert "orders.placed" in page
