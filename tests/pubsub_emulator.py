"""Google's Pub/Sub emulator (``gcloud beta emulators pubsub start``) on a loopback port of its own,
and a reader of one subscription.

The emulator keeps everything in memory: a restart loses its topics, subscriptions and the
messages it held (``start()`` again, then ``create()`` what the test needs, as an operator's
infrastructure would have them). It checks fewer limits than Pub/Sub: attribute names and sizes
are not checked at all (the sink enforces Pub/Sub's itself; tests/unit/sinks checks that).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.aws_servers import free_port
from tests.helpers import wait_for

PROJECT = "outbox-tests"


class Emulator:
    """The emulator on its own port; ``stop()``/``start()`` keep the port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Emulator:
        self.proc = subprocess.Popen(
            ["gcloud", "beta", "emulators", "pubsub", "start", f"--host-port={self.host}", "--quiet"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # gcloud runs java: stop() ends the whole group
        )

        def up() -> bool:
            proc = self.proc
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the Pub/Sub emulator exited with {proc.returncode} before it listened")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(up, timeout=120, what="Pub/Sub emulator")
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

        def closed() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) != 0

        wait_for(closed, timeout=30, what="the emulator's port to close")

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """``PUBSUB_EMULATOR_HOST`` set for the block (the sink's client and the reader's)."""
        before = os.environ.get("PUBSUB_EMULATOR_HOST")
        os.environ["PUBSUB_EMULATOR_HOST"] = self.host
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("PUBSUB_EMULATOR_HOST", None)
            else:
                os.environ["PUBSUB_EMULATOR_HOST"] = before

    def create(self, topic: str) -> str:
        """``topic`` and an ordered subscription of it (named after it); the subscription's path."""
        from google.api_core import exceptions
        from google.cloud import pubsub_v1

        with self.environment():
            publisher = pubsub_v1.PublisherClient()
            subscriber = pubsub_v1.SubscriberClient()
            path = publisher.topic_path(PROJECT, topic)
            subscription = subscriber.subscription_path(PROJECT, f"{topic}-reader")
            with contextlib.suppress(exceptions.AlreadyExists):
                publisher.create_topic(name=path)
            with contextlib.suppress(exceptions.AlreadyExists):
                subscriber.create_subscription(
                    request={"name": subscription, "topic": path, "enable_message_ordering": True}
                )
            subscriber.close()
        return subscription


@dataclass
class Received:
    data: bytes
    ordering_key: str
    attributes: dict[str, str]
    message_id: str

    @property
    def event_id(self) -> str:
        return self.attributes["event-id"]


class Reader:
    """Pulls a subscription in a thread, acknowledging what it read, until ``close()``; what
    arrived is ``received``, in arrival order (a key's messages come in order: the subscription
    orders them). A pull that fails (the emulator is down) is tried again."""

    def __init__(self, emulator: Emulator, subscription: str) -> None:
        self.emulator = emulator
        self.subscription = subscription
        self.received: list[Received] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from google.cloud import pubsub_v1

        with self.emulator.environment():
            subscriber: Any = pubsub_v1.SubscriberClient()
        while not self._stop.is_set():
            try:
                response = subscriber.pull(
                    request={"subscription": self.subscription, "max_messages": 1000}, timeout=2
                )
            except Exception:  # the emulator is down, or the subscription not made again yet
                time.sleep(0.2)
                continue
            ack = []
            for r in response.received_messages:
                m = r.message
                self.received.append(Received(m.data, m.ordering_key, dict(m.attributes), m.message_id))
                ack.append(r.ack_id)
            if ack:
                with contextlib.suppress(Exception):
                    subscriber.acknowledge(request={"subscription": self.subscription, "ack_ids": ack})
        subscriber.close()

    def wait(self, expected: int, timeout: float = 60.0) -> list[Received]:
        wait_for(
            lambda: len({m.event_id for m in self.received}) >= expected,
            timeout=timeout,
            what=f"{expected} messages",
        )
        return self.received

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
