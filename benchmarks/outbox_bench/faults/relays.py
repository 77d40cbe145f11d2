"""``outbox relay`` processes under test: started, signalled, watched and counted.

Each relay is the real CLI in its own process, with JSON logs in its own file
and its own ``/metrics`` port. What the relays did (acks refused after a lost
lease, sinks replaced, database outages, partitions lost) is counted from the
structured ``event`` field of their log lines, which survives a SIGKILL and
does not depend on the wording of a message.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from outbox.harness.embedded import free_port
from outbox.store.dsn import for_child
from outbox_bench.faults.config import FaultConfig

# Structured log events, and what the report calls them.
COUNTED_EVENTS = {
    "lease.lost": "stale_acks_refused",
    "sink.replaced": "producers_recreated",
    # Why a Kafka producer was replaced: it could deliver no more (fenced, its epoch or id
    # unknown to the broker), a message had no report for a delivery timeout (its deadline), or
    # no delivery succeeded for 3 delivery timeouts.
    "kafka.lost": "producers_lost",
    "kafka.deadline": "producers_past_deadline",
    "kafka.stuck": "producers_stuck",
    "database.started": "reconnects",
    "ownership.lost": "ownership_lost",
    # A sink beyond Kafka found unreachable (its outage condition started).
    "amqp.started": "sink_outages",
    "nats.started": "sink_outages",
    "redis.started": "sink_outages",
    "http.started": "sink_outages",
    "sqs.started": "sink_outages",
    "sns.started": "sink_outages",
    "eventbridge.started": "sink_outages",
    "kinesis.started": "sink_outages",
}
SCRAPE_TIMEOUT = 2.0  # seconds


def poll_until(check: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``check()`` until it is true or ``timeout`` seconds pass; returns whether it became true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return False


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
    """SIGCONT (a stopped process cannot stop) and SIGTERM to each process, then their exit
    codes; one that does not exit within ``timeout`` s is killed."""
    codes: list[int | None] = []
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


class Relays:
    """``outbox relay`` processes (the real CLI), each with its own log file and metrics port."""

    def __init__(
        self,
        cfg: FaultConfig,
        schema: str,
        name: str,
        extra: list[str],
        env: dict[str, str],
        route: str | None = None,
        dsn: str | None = None,
    ) -> None:
        self.cfg, self.schema, self.name, self.extra = cfg, schema, name, extra
        # The blackhole-pg scenario: through a proxy. Its password goes in the environment (ps).
        self.dsn, secret = for_child(dsn or cfg.dsn)
        # --route GLOB=URL for a sink other than Kafka, else the run's Kafka cluster.
        self.sink_args = ["--route", route] if route else ["--kafka-bootstrap", cfg.bootstrap]
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}, **env, **secret}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.ports: dict[int, int] = {}
        self.logs: list[Path] = []
        self.log_of: dict[int, Path] = {}  # relay index -> its latest log
        self.starts = 0

    def start(self, index: int) -> None:
        cfg = self.cfg
        self.starts += 1
        log = cfg.log_dir / f"{self.name}-relay{index}-{self.starts}.log"
        self.logs.append(log)
        self.log_of[index] = log
        self.ports[index] = port = free_port()
        with open(log, "wb") as out:
            self.procs[index] = subprocess.Popen(
                [
                    sys.executable, "-m", "outbox", "relay",
                    "--dsn", self.dsn, "--schema", self.schema, *self.sink_args,
                    "--name", f"{self.name}-{index}",
                    "--lease", str(cfg.lease), "--delivery-timeout", str(cfg.delivery_timeout),
                    "--ownership-lease", str(cfg.ownership_lease),
                    "--poll-interval", "0.5", "--grace", "5",
                    "--retry-base", "0.2", "--retry-cap", "2", "--max-attempts", "1000",
                    "--metrics-port", str(port), "--log-format", "json", "--log-level", "info",
                    *self.extra,
                ],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def get(self, index: int, path: str) -> tuple[int, str]:
        """(status, body) of GET ``path`` on relay ``index``'s metrics port; (0, "") if it does not answer."""
        url = f"http://127.0.0.1:{self.ports[index]}{path}"
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode(errors="replace")
        except (OSError, urllib.error.URLError):
            return 0, ""

    def metric(self, index: int, name: str) -> float:
        """A metric of relay ``index``, summed over its series (its outboxes, topics...); 0 when
        the relay does not answer."""
        _, body = self.get(index, "/metrics")
        total = 0.0
        for line in body.splitlines():
            if line.startswith((name + " ", name + "{")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_ready(self, index: int) -> None:
        """Until relay ``index`` answers /readyz with 200; fails loudly when it does not, with
        why: its exit, or its last /readyz answer and the end of its log."""
        answer = [(0, "")]
        proc = self.procs[index]

        def ready() -> bool:
            answer[0] = self.get(index, "/readyz")
            return answer[0][0] == 200 or proc.poll() is not None

        if poll_until(ready, self.cfg.ready_timeout) and proc.poll() is None:
            return
        status, body = answer[0]
        why = (
            f"exited with {proc.returncode}"
            if proc.poll() is not None
            else f"/readyz {status or 'no answer'}: {body.strip()[:300]!r}"
        )
        tail = self.log_of[index].read_text(errors="replace")[-1500:]
        raise RuntimeError(
            f"relay {index} did not become ready in {self.cfg.ready_timeout:.0f} s ({why}); "
            f"its log ends:\n{tail}"
        )

    def signal(self, index: int, sig: signal.Signals) -> None:
        self.procs[index].send_signal(sig)

    def kill(self, index: int) -> None:
        self.procs[index].kill()
        self.procs[index].wait()

    def restart(self, index: int, graceful: bool = False) -> None:
        if graceful:
            self.procs[index].terminate()
            self.procs[index].wait(30)
        else:
            self.kill(index)
        self.start(index)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]

    def stop_all(self) -> list[int | None]:
        return stop_processes(list(self.procs.values()), 30)

    def events(self) -> dict[str, int]:
        """Counts of the structured events the report names, over every relay's log."""
        seen: collections.Counter[str] = collections.Counter()
        for path in self.logs:
            with contextlib.suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    if not line.startswith("{"):
                        continue
                    with contextlib.suppress(ValueError):
                        event = json.loads(line).get("event")
                        if event:
                            seen[event] += 1
        counts = dict.fromkeys(COUNTED_EVENTS.values(), 0)
        for event, report in COUNTED_EVENTS.items():
            counts[report] += seen.get(event, 0)
        return counts
