"""What the Pub/Sub sink published, read back (``pubsub://PROJECT/NAME`` in the bench's sinks).

Only against Google's emulator (``PUBSUB_EMULATOR_HOST``): the bench makes the run's own topic
``NAME-<tag>`` and an ordered subscription of it there, and deletes both afterwards. The fault
harness's proxy cannot stand between Google's client and the service (the client takes its
endpoint from that variable, or TLS to Google itself), so ``route`` refuses any other address.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from typing import Any

from outbox_bench.harness.sinktaps import SinkTap

from outbox.errors import ConfigError
from outbox.sinks.routes import parse_url


class PubSubTap(SinkTap):
    scheme = "pubsub"

    def __init__(self, url: str, topic: str) -> None:
        parsed = parse_url(url, "--sink")
        host = os.environ.get("PUBSUB_EMULATOR_HOST")
        if not host:
            raise ConfigError(
                f"{parsed.display!r} needs PUBSUB_EMULATOR_HOST (gcloud beta emulators pubsub start): "
                "the bench makes and deletes topics there"
            )
        self.project = parsed.parts.netloc
        self.dest = f"{parsed.parts.path.strip('/')}-{uuid.uuid4().hex[:8]}"
        super().__init__(url, topic)
        name, _, port = host.rpartition(":")
        self.server = (name, int(port))
        self.position = 0
        self._publisher: Any = None
        self._subscriber: Any = None

    @property
    def path(self) -> str:
        return f"projects/{self.project}/topics/{self.dest}"

    @property
    def subscription(self) -> str:
        return f"projects/{self.project}/subscriptions/{self.dest}-tap"

    def route(self, host: str, port: int) -> str:
        if (host, port) != self.server:
            raise ConfigError("pubsub://: no proxy can stand in front of Google's client; use it directly")
        return f"pubsub://{self.project}/{self.dest}"

    def setup(self) -> None:
        from google.cloud import pubsub_v1

        self._publisher = pubsub_v1.PublisherClient()
        self._subscriber = pubsub_v1.SubscriberClient()
        self._publisher.create_topic(name=self.path)
        self._subscriber.create_subscription(
            request={"name": self.subscription, "topic": self.path, "enable_message_ordering": True}
        )

    def teardown(self) -> None:
        with contextlib.suppress(Exception):  # the emulator may be gone with the run
            self._subscriber.delete_subscription(subscription=self.subscription)
            self._publisher.delete_topic(topic=self.path)
            self._subscriber.close()

    async def read(self) -> None:
        self.ready.set()
        while not self.stop_event.is_set():
            try:
                response = await asyncio.to_thread(
                    self._subscriber.pull,
                    request={"subscription": self.subscription, "max_messages": 1000},
                    timeout=2,
                )
            except Exception:  # nothing yet (the emulator answers an empty pull with a deadline)
                continue
            ack = []
            for received in response.received_messages:
                message = received.message
                self.position += 1
                self.record(message.attributes.get("event-id", ""), message.data, self.position)
                ack.append(received.ack_id)
            if ack:
                await asyncio.to_thread(
                    self._subscriber.acknowledge, request={"subscription": self.subscription, "ack_ids": ack}
                )
