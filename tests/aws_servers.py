"""AWS under test: moto in server mode on a loopback port, a destination of its own per test,
and a proxy that answers as AWS does when it throttles or refuses.

moto proves the calls are well-formed and the answers (per-entry results, errors) are read
right. It does not prove the services' limits beyond the ones it checks, their latency, IAM,
or the ordering of a real SQS standard queue (moto's keeps arrival order; AWS's does not, so
readers there rely on the event's own sequence, as the consumer recipes do).

Each target reads what arrived back as :class:`tests.helpers.Message`:
- ``sqs``/``sqs-fifo``: the queue itself;
- ``sns``: an SQS queue subscribed with raw message delivery (attributes kept);
- ``eventbridge``: an SQS queue, target of a rule on the bus (the event's envelope; the
  event id from ``resources``);
- ``kinesis``: the stream's shards, read from their start.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qsl

import boto3

from tests.helpers import Message, wait_for
from tests.sink_servers import Target

REGION = "us-east-1"
AWS_SINKS = ("sqs", "sqs-fifo", "sns", "eventbridge", "kinesis")
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
}
SEND_OPERATIONS = ("SendMessageBatch", "PublishBatch", "PutEvents", "PutRecords")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Moto:
    """moto in server mode on a loopback port, one request at a time (tests/moto_server.py);
    ``stop()``/``start()`` keep the port (and, being in memory, a restart loses everything it held)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Moto:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.moto_server", "127.0.0.1", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )

        def up() -> bool:
            proc = self.proc
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the moto server exited with {proc.returncode} before it listened")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        # moto imports for seconds; beside the suite on a machine at half its pace it took over
        # 30 s once, and every AWS test of that worker failed at its start.
        wait_for(up, timeout=120, what="moto server")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def client(self, service: str) -> Any:
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def bucket(self, name: str) -> None:
        self.client("s3").create_bucket(Bucket=name)


def _strings(value: Any) -> list[str]:
    """Every string in a decoded JSON request (a Kinesis record's Data decoded too)."""
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if k == "Data" and isinstance(v, str):
                out.append(base64.b64decode(v).decode("utf-8", "replace"))
            else:
                out += _strings(v)
        return out
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


class AwsProxy:
    """An HTTP proxy in front of moto that answers as AWS does when it throttles or refuses:
    ``throttle(n)``: the next ``n`` send calls get the service's throttling error;
    ``refuse(marker)``: a send call holding ``marker`` anywhere in it gets AccessDenied (the
    sink then sends its entries one by one, so only that event is refused)."""

    THROTTLE: ClassVar[dict[str, str]] = {
        "sqs": "RequestThrottled",
        "sns": "Throttling",
        "events": "ThrottlingException",
        "kinesis": "ProvisionedThroughputExceededException",
    }

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.throttles = 0
        self.throttled = 0
        self.marker: str | None = None
        self.refused = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                answer = proxy.intercept(dict(self.headers), body)
                if answer is None:
                    answer = proxy.forward(self.command, self.path, dict(self.headers), body)
                status, headers, data = answer
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def throttle(self, n: int) -> None:
        with self.lock:
            self.throttles = n

    def refuse(self, marker: str) -> None:
        self.marker = marker

    def intercept(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes] | None:
        target = headers.get("X-Amz-Target", "")
        is_json = "json" in headers.get("Content-Type", "")
        if is_json:
            operation = target.rsplit(".", 1)[-1]
            service = {"AmazonSQS": "sqs", "AWSEvents": "events"}.get(target.split(".")[0], "kinesis")
            strings = _strings(json.loads(body or b"{}"))
        else:
            form = dict(parse_qsl(body.decode("utf-8", "replace")))
            operation, service = form.get("Action", ""), "sns"
            strings = list(form.values())
        if operation not in SEND_OPERATIONS:
            return None
        with self.lock:
            if self.throttles > 0:
                self.throttles -= 1
                self.throttled += 1
                return self.error(is_json, self.THROTTLE[service], "Rate exceeded", 400)
        if self.marker and any(self.marker in s for s in strings):
            with self.lock:
                self.refused += 1
            return self.error(is_json, "AccessDeniedException" if is_json else "AuthorizationError",
                              "User is not authorized to perform this action on this resource", 403)  # fmt: skip
        return None

    @staticmethod
    def error(is_json: bool, code: str, message: str, status: int) -> tuple[int, dict[str, str], bytes]:
        if is_json:
            headers = {"Content-Type": "application/x-amz-json-1.0", "x-amzn-ErrorType": code}
            return status, headers, json.dumps({"__type": code, "message": message}).encode()
        xml = (
            f"<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message>"
            f"</Error><RequestId>{uuid.uuid4()}</RequestId></ErrorResponse>"
        )
        return status, {"Content-Type": "text/xml"}, xml.encode()

    def forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class AwsTarget(Target):
    """One test's destination on one AWS service, in moto (``read`` as every sink target's)."""

    scheme = ""
    kind = ""

    def __init__(self, moto: Moto) -> None:
        self.moto = moto
        self.name = f"t-{uuid.uuid4().hex[:10]}"
        self.topic = "orders.created"
        self.sqs = moto.client("sqs")
        self._got: list[Message] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def draining(self) -> Iterator[None]:
        """Read what arrives while the block runs, as a consumer would: moto's SQS answers more
        slowly the more messages a queue holds (a FIFO queue's 600th send took 0.5 s)."""
        stop = threading.Event()

        def drain() -> None:
            while not stop.wait(0.2):
                self.fetch()

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(30)

    def url(self, endpoint: str | None = None, **options: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"region": REGION, **options,
                                                  "endpoint": endpoint or self.moto.endpoint}.items())  # fmt: skip
        return f"{self.scheme}://{self.resource}?{query}"

    @property
    def resource(self) -> str:
        return self.name

    def fetch(self) -> list[Message]:
        raise NotImplementedError

    def _queue(self, name: str, fifo: bool = False) -> tuple[str, str]:
        attributes = {"FifoQueue": "true"} if fifo else {}
        url = self.sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        arn = self.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"][
            "QueueArn"
        ]
        return url, arn

    def _drain_queue(self, url: str, decode: Any) -> list[Message]:
        with self._lock:
            return self._drain_locked(url, decode)

    def _drain_locked(self, url: str, decode: Any) -> list[Message]:
        while True:
            got = self.sqs.receive_message(
                QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"], AttributeNames=["All"]
            ).get("Messages", [])
            if not got:
                break
            for m in got:
                self._got.append(decode(m, len(self._got)))
            self.sqs.delete_message_batch(
                QueueUrl=url,
                Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got)],
            )
        return list(self._got)


def sqs_message(m: dict[str, Any], position: int) -> Message:
    """An SQS message (or an SNS one, delivered raw) as the event it carries."""
    attributes = {k: v.get("StringValue", "") for k, v in m.get("MessageAttributes", {}).items()}
    body = m["Body"]
    value = (
        base64.b64decode(body) if attributes.pop("outbox-body-encoding", "") == "base64" else body.encode()
    )
    headers = {k: v.encode() for k, v in attributes.items() if k != "outbox-headers"}
    for k, v in json.loads(attributes.get("outbox-headers", "{}")).items():
        headers[k] = base64.b64decode(v["base64"]) if isinstance(v, dict) else v.encode()
    headers["x-message-id"] = m["MessageId"].encode()
    if "SequenceNumber" in m.get("Attributes", {}):
        headers["x-sequence"] = m["Attributes"]["SequenceNumber"].encode()
        headers["x-group"] = m["Attributes"]["MessageGroupId"].encode()
    key = headers.pop("event-key", None)
    return Message(key, value, headers, 0, position)


class SqsTarget(AwsTarget):
    scheme = kind = "sqs"
    fifo = False

    def __init__(self, moto: Moto) -> None:
        super().__init__(moto)
        if self.fifo:
            self.name += ".fifo"
        self.queue_url, _ = self._queue(self.name, self.fifo)

    def fetch(self) -> list[Message]:
        return self._drain_queue(self.queue_url, sqs_message)


class SqsFifoTarget(SqsTarget):
    kind = "sqs-fifo"
    fifo = True


class SnsTarget(AwsTarget):
    scheme = kind = "sns"

    def __init__(self, moto: Moto) -> None:
        super().__init__(moto)
        sns = moto.client("sns")
        arn = sns.create_topic(Name=self.name)["TopicArn"]
        self.queue_url, queue_arn = self._queue(self.name + "-sub")
        sns.subscribe(
            TopicArn=arn, Protocol="sqs", Endpoint=queue_arn, Attributes={"RawMessageDelivery": "true"}
        )

    def fetch(self) -> list[Message]:
        return self._drain_queue(self.queue_url, sqs_message)


class EventBridgeTarget(AwsTarget):
    scheme = kind = "eventbridge"
    source = "orders-service"

    def __init__(self, moto: Moto) -> None:
        super().__init__(moto)
        events = moto.client("events")
        events.create_event_bus(Name=self.name)
        self.queue_url, queue_arn = self._queue(self.name + "-target")
        events.put_rule(
            Name="all", EventBusName=self.name, EventPattern=json.dumps({"source": [self.source]})
        )
        events.put_targets(Rule="all", EventBusName=self.name, Targets=[{"Id": "q", "Arn": queue_arn}])

    def url(self, endpoint: str | None = None, **options: str) -> str:
        return super().url(endpoint, source=self.source, **options)

    def fetch(self) -> list[Message]:
        def decode(m: dict[str, Any], position: int) -> Message:
            envelope = json.loads(m["Body"])
            event_id = envelope["resources"][0].removeprefix("urn:uuid:")
            headers = {
                "event-id": event_id.encode(),
                "x-detail-type": envelope["detail-type"].encode(),
                "x-source": envelope["source"].encode(),
                "x-time": envelope["time"].encode(),
                "x-eventbridge-id": envelope["id"].encode(),
            }
            return Message(None, json.dumps(envelope["detail"]).encode(), headers, 0, position)

        return self._drain_queue(self.queue_url, decode)


class KinesisTarget(AwsTarget):
    """A stream of two shards; ``envelope`` (the URL's ``envelope=json``) carries the event id."""

    scheme = kind = "kinesis"

    def __init__(self, moto: Moto, envelope: bool = True) -> None:
        super().__init__(moto)
        self.kinesis = moto.client("kinesis")
        self.kinesis.create_stream(StreamName=self.name, ShardCount=2)
        self.envelope = envelope

    def url(self, endpoint: str | None = None, **options: str) -> str:
        extra = {"envelope": "json"} if self.envelope else {}
        return super().url(endpoint, **{**extra, **options})

    def fetch(self) -> list[Message]:
        out: list[Message] = []
        for shard in self.kinesis.list_shards(StreamName=self.name)["Shards"]:
            it = self.kinesis.get_shard_iterator(
                StreamName=self.name, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
            )["ShardIterator"]
            while it:
                page = self.kinesis.get_records(ShardIterator=it, Limit=1000)
                for r in page["Records"]:
                    out.append(self._message(r, shard["ShardId"], len(out)))
                if not page["Records"]:
                    break
                it = page.get("NextShardIterator")
        return out

    def _message(self, r: dict[str, Any], shard: str, position: int) -> Message:
        headers = {"x-shard": shard.encode(), "x-sequence": r["SequenceNumber"].encode()}
        if not self.envelope:
            return Message(r["PartitionKey"].encode(), r["Data"], headers, 0, position)
        body = json.loads(r["Data"])
        headers["event-id"] = body["id"].encode()
        for k, v in body["headers"].items():
            headers[k] = base64.b64decode(v["base64"]) if isinstance(v, dict) else v.encode()
        value = (
            base64.b64decode(body["payload_base64"])
            if "payload_base64" in body
            else json.dumps(body["payload"]).encode()
        )
        key = body["key"].encode() if isinstance(body["key"], str) else None
        return Message(key, value, headers, 0, position)


def aws_target(kind: str, moto: Moto) -> AwsTarget:
    return {
        "sqs": SqsTarget,
        "sqs-fifo": SqsFifoTarget,
        "sns": SnsTarget,
        "eventbridge": EventBridgeTarget,
        "kinesis": KinesisTarget,
    }[kind](moto)
