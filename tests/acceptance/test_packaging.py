"""The release, as a user gets it: the sdist and the wheel built with ``python -m build``, their
metadata read by ``twine check --strict``, and the wheel (not the source tree) installed with
extras into a fresh virtualenv, where the README's first command (``outbox demo``) runs green and
its quickstart runs from nothing to a consumed event, block by block as the README writes them
(on ``outbox dev``'s servers: this machine's own PostgreSQL has port 5432), and the console
answers. Nothing of the source tree is on that virtualenv's path."""

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
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import outbox
from outbox.harness.embedded import port_open

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
EXAMPLE = re.compile(r"<!-- example: (\w+) -->\n```python\n(.*?)```", re.DOTALL)
TERMINAL = re.compile(r"<!-- terminal: (\w+) -->\n```sh\n(.*?)```", re.DOTALL)
EXTRAS = "console,aws,nats,sqlalchemy,embedded"
QUICKSTART_PACKAGES = {"fastapi", "uvicorn"}  # what the README's pip lines add to the extras
ORDERS = 300  # placed through the app (the README's one, then the test's), relayed, consumed
# The release's build (python -m build); uv fills its isolated build environments from its cache,
# at half pip's CPU.
BUILD = (sys.executable, "-m", "build", "--installer", "uv")

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
def _process(
    *args: str | Path, env: dict[str, str], cwd: Path, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(a) for a in args],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
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


def _can_connect(dsn: str) -> bool:
    try:
        psycopg.connect(dsn, connect_timeout=3).close()
    except psycopg.OperationalError:
        return False
    return True


def _count(dsn: str, query: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def test_the_release_installs_from_its_wheel_and_the_quickstart_runs(tmp_path: Path) -> None:
    # The sdist, then the wheel built from it (python -m build's default): what the sdist forgot,
    # the wheel misses.
    dist = tmp_path / "dist"
    _run(*BUILD, "--outdir", dist, ROOT, timeout=400)
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
    # The runtime alone: the bench, the fault suite, the explorer and their taps, proxy and SQL
    # are outbox-relay-bench's (benchmarks/), and the harness keeps what `outbox demo` and
    # `outbox dev` run.
    assert not [n for n in names if n.startswith(("outbox/bench/", "outbox_bench/"))]
    harness = {n.removeprefix("outbox/harness/") for n in names if n.startswith("outbox/harness/")}
    assert harness == {
        f"{m}.py" for m in ("__init__", "demo", "dev", "embedded", "pginstall", "infra", "load", "tap")
    }
    assert not {"outbox/store/sql/bench.sql", "outbox/store/sql/explore.sql"} & names
    _bench_distribution(tmp_path / "bench-dist")
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

    # Without outbox-relay-bench, `outbox bench` is one line saying what to install.
    bench = subprocess.run(
        [bin_ / "outbox", "bench", "--smoke"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert bench.returncode == 2 and bench.stdout == "", bench
    assert bench.stderr.count("\n") == 1 and "pip install outbox-relay-bench" in bench.stderr, bench.stderr

    blocks = dict(TERMINAL.findall(README))
    demo = _lines(blocks["demo"]).replace("--seconds 20", "--seconds 3")  # the same, shorter
    done = _run("bash", "-euo", "pipefail", "-c", demo, env=env, cwd=tmp_path, timeout=180)
    assert "demo: every committed event was consumed" in done.stdout + done.stderr, done.stdout + done.stderr
    _quickstart(env, bin_, tmp_path, blocks)


def _bench_distribution(dist: Path) -> None:
    """outbox-relay-bench, built from benchmarks/ as the release builds it: its modules, its SQL
    under its own package, `outbox bench` as an entry point, and outbox-relay at the same version."""
    _run(*BUILD, "--outdir", dist, ROOT / "benchmarks", timeout=400)
    [wheel] = dist.glob("outbox_relay_bench-*.whl")
    assert wheel.name == f"outbox_relay_bench-{outbox.__version__}-py3-none-any.whl"
    _run(sys.executable, "-m", "twine", "check", "--strict", *dist.iterdir())
    zipped = zipfile.ZipFile(wheel)
    info = f"outbox_relay_bench-{outbox.__version__}.dist-info"
    names = set(zipped.namelist())
    for shipped in (
        "outbox_bench/cli.py",
        "outbox_bench/faults/suite.py",
        "outbox_bench/explore/seeds.py",
        "outbox_bench/harness/proxy.py",
        "outbox_bench/sql/bench.sql",
        "outbox_bench/sql/explore.sql",
    ):
        assert shipped in names, shipped
    assert {n.split("/")[0] for n in names} == {"outbox_bench", info}
    entry = zipped.read(f"{info}/entry_points.txt").decode()
    assert "[outbox.commands]\nbench = outbox_bench.cli:register" in entry, entry
    metadata = zipped.read(f"{info}/METADATA").decode().splitlines()
    assert f"Requires-Dist: outbox-relay[embedded]=={outbox.__version__}" in metadata


def _lines(block: str) -> str:
    """A README block's lines, less its ``pip install`` lines: the virtualenv has what they name."""
    kept = []
    for line in block.splitlines():
        if line.startswith("pip install"):
            for word in line.split()[2:]:
                name, _, extras = word.strip("'").partition("[")
                assert name == "outbox-relay" or name in QUICKSTART_PACKAGES, line
                assert set(extras.rstrip("]").split(",")) - {""} <= set(EXTRAS.split(",")), line
        else:
            kept.append(line)
    return "\n".join(kept)


@contextlib.contextmanager
def _terminal(
    block: str, ports: dict[int, int], env: dict[str, str], cwd: Path, log: Path, password: str = "postgres"
) -> Iterator[subprocess.Popen[bytes]]:
    """One of the README's terminals: its lines as written, on this test's ports (the README's
    in ``ports``) and with the password `outbox dev` printed, the last one exec'd, so that a
    signal reaches it as Ctrl-C's would."""
    script = _lines(block).replace("postgres:postgres@", f"postgres:{password}@")
    for theirs, ours in ports.items():
        script = script.replace(f"localhost:{theirs}", f"localhost:{ours}")
    *head, last = script.splitlines()
    with _process(
        "bash", "-euo", "pipefail", "-c", "\n".join([*head, f"exec {last}"]), env=env, cwd=cwd, log=log
    ) as proc:
        yield proc


def _quickstart(env: dict[str, str], bin_: Path, tmp_path: Path, blocks: dict[str, str]) -> None:
    """The README's quickstart, its terminals and its programs as written there."""
    pg, kafka, http = _free_port(), _free_port(), _free_port()
    ports = {5432: pg, 9092: kafka, 8000: http}
    programs = dict(EXAMPLE.findall(README))
    (tmp_path / "app.py").write_text(programs["app"])
    (tmp_path / "consumer.py").write_text(programs["consumer"])
    log = {name: tmp_path / f"{name}.log" for name in ("servers", "app", "relay", "consumer")}
    servers_env = env | {"OUTBOX_DEV_PG_PORT": str(pg), "OUTBOX_DEV_KAFKA_PORT": str(kafka)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_terminal(blocks["servers"], ports, servers_env, tmp_path, log["servers"]))
        _wait_for("outbox dev", lambda: "export DATABASE_URL" in log["servers"].read_text(), 120)
        # What it prints is the line the README's terminals start with, with its own password.
        [export] = [x for x in log["servers"].read_text().splitlines() if x.startswith("export ")]
        password = re.search(r"postgresql://postgres:([^@]+)@", export)[1]  # type: ignore[index]
        assert password != "postgres" and len(password) >= 24, "a password generated at start"
        database = f"postgresql://postgres:{password}@localhost:{pg}/shop"
        assert not _can_connect(f"postgresql://postgres:postgres@localhost:{pg}/shop")
        export = export.replace(f"postgres:{password}@", "postgres:postgres@")
        for theirs, ours in ports.items():
            export = export.replace(f"localhost:{ours}", f"localhost:{theirs}")
        assert all(
            block.startswith(export) for name, block in blocks.items() if name in ("relay", "consumer")
        )

        app_env = env | {"UVICORN_PORT": str(http)}
        stack.enter_context(_terminal(blocks["app"], ports, app_env, tmp_path, log["app"], password))
        _wait_for("the app", lambda: _listening(http), 120)
        relay = stack.enter_context(_terminal(blocks["relay"], ports, env, tmp_path, log["relay"], password))

        order = _lines(blocks["order"]).replace("localhost:8000", f"localhost:{http}")
        answer = _run("bash", "-euo", "pipefail", "-c", order, env=env, cwd=tmp_path)
        assert json.loads(answer.stdout) == {"order": "1"}
        for n in range(2, ORDERS + 1):
            request = urllib.request.Request(f"http://127.0.0.1:{http}/orders/sku-{n}", method="POST")
            with urllib.request.urlopen(request, timeout=10) as reply:
                assert json.loads(reply.read())["order"] == str(n)
        _wait_for(
            "the relay's drain",
            lambda: _count(database, "SELECT count(*) FROM outbox.delivered") == ORDERS,
            120,
        )
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0, log["relay"].read_text()[-3000:]
        assert _count(database, "SELECT count(*) FROM outbox.events") == 0

        consumer = stack.enter_context(
            _terminal(blocks["consumer"], ports, env, tmp_path, log["consumer"], password)
        )
        _wait_for("the consumer", lambda: _count(database, "SELECT count(*) FROM shipments") == ORDERS, 120)
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(30) == 0, log["consumer"].read_text()[-3000:]
        said = log["consumer"].read_text()
        assert "shipping order 1\n" in said and "Traceback" not in said, said[-3000:]
        assert _count(database, "SELECT count(*) FROM outbox.inbox") == ORDERS
        _console_answers(env, bin_, tmp_path, database)
    # Stopped, `outbox dev` leaves no postmaster behind (its restarted one kept the port before).
    _wait_for("outbox dev's PostgreSQL to stop", lambda: not port_open(pg), 30)


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
