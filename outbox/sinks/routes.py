"""Routes: which sink each topic goes to (``--route GLOB=URL``, ``OUTBOX_ROUTES``).

A route is ``GLOB=URL``. The glob matches the event's topic, case-sensitively,
``fnmatch`` style (``orders.*``, ``*``), and the first route that matches wins.
``--kafka-bootstrap B`` is kept and means a last route ``*=kafka://B``. An event
whose topic matches no route is dead-lettered at once with the reason
``no route for topic '<topic>'`` — parked like any keyed dead letter, so adding
the route and redriving delivers it in order.

A route or URL that cannot be used is refused at start, with an error naming it.
Credentials in a URL never appear in what is shown: :attr:`SinkURL.display` is
the scheme, host and path without them (it is the ``sink`` metric label too); a webhook's
path and query, which often hold its token, are shown as a short digest.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import NamedTuple
from urllib.parse import SplitResult, parse_qsl, urlsplit

from outbox.errors import ConfigError


class Scheme(NamedTuple):
    """What a route's URL scheme names: the system, the extra its client comes in (None:
    always installed), the sink class, as ``module:Class`` (imported only when used), and
    the query options its URL takes with their types (None: any, as webhook URLs keep
    their query for the endpoint)."""

    system: str
    extra: str | None
    sink: str
    options: dict[str, type] | None = None


_RABBITMQ = Scheme(
    "RabbitMQ",
    "rabbitmq",
    "outbox.sinks.rabbitmq:RabbitMQSink",
    {"exchange": str, "max_message_size": int, "heartbeat": int},
)
_NATS = Scheme("NATS JetStream", "nats", "outbox.sinks.nats:NatsSink", {})
_REDIS = Scheme("Redis Streams", "redis", "outbox.sinks.redis:RedisSink", {"maxlen": int})
_WEBHOOKS = Scheme("webhooks", "http", "outbox.sinks.webhook:WebhookSink")
_AWS_OPTIONS: dict[str, type] = {"region": str, "endpoint": str}
AWS_SCHEMES = ("sqs", "sns", "eventbridge", "kinesis")
SCHEMES: dict[str, Scheme] = {
    "kafka": Scheme("Kafka", None, "outbox.sinks.kafka:KafkaSink"),
    "amqp": _RABBITMQ,
    "amqps": _RABBITMQ,
    "nats": _NATS,
    "tls": _NATS,
    "redis": _REDIS,
    "rediss": _REDIS,
    "http": _WEBHOOKS,
    "https": _WEBHOOKS,
    "sqs": Scheme("Amazon SQS", "aws", "outbox.sinks.aws:SqsSink", _AWS_OPTIONS),
    "sns": Scheme("Amazon SNS", "aws", "outbox.sinks.aws:SnsSink", _AWS_OPTIONS),
    "eventbridge": Scheme(
        "Amazon EventBridge", "aws", "outbox.sinks.aws:EventBridgeSink", {**_AWS_OPTIONS, "source": str}
    ),
    "kinesis": Scheme(
        "Amazon Kinesis", "aws", "outbox.sinks.kinesis:KinesisSink", {**_AWS_OPTIONS, "envelope": str}
    ),
    "pubsub": Scheme("Google Cloud Pub/Sub", "gcp", "outbox.sinks.pubsub:PubSubSink", {"endpoint": str}),
}
_PUBSUB_PROJECT = re.compile(r"[a-z][a-z0-9\-]{4,28}[a-z0-9]")
_PUBSUB_TOPIC = re.compile(r"[A-Za-z][A-Za-z0-9\-_.~+%]{2,254}")
_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


@dataclass(frozen=True)
class SinkURL:
    """A parsed sink URL; ``display`` is safe to show (no credentials)."""

    scheme: str
    parts: SplitResult
    text: str  # as given (may hold a password: never log it)

    @property
    def display(self) -> str:
        if self.scheme == "kafka":  # several host:port pairs: urllib cannot parse it as one host
            return f"kafka://{self.kafka_bootstrap}"
        if self.scheme in AWS_SCHEMES or self.scheme == "pubsub":  # names, case kept; never a password
            query = f"?{self.parts.query}" if self.parts.query else ""
            return f"{self.scheme}://{self.resource}{query}"
        host = self.parts.hostname or ""
        try:
            port = f":{self.parts.port}" if self.parts.port else ""
        except ValueError:  # refused by parse_url; shown as given
            port = ""
        if self.scheme in ("http", "https"):
            # A webhook URL's path and query often hold its token (a Slack-style hook's is in the
            # path): never shown. A short digest of the whole URL tells two routes apart.
            if self.parts.path.strip("/") or self.parts.query:
                digest = hashlib.sha256(self.text.encode()).hexdigest()[:6]
                return f"{self.scheme}://{host}{port}/…({digest})"
            return f"{self.scheme}://{host}{port}/"
        query = f"?{self.parts.query}" if self.parts.query else ""  # options only
        return f"{self.scheme}://{host}{port}{self.parts.path}{query}"

    @property
    def hidden(self) -> list[str]:
        """Parts of the URL as given that must not be shown: its password, and a webhook's path
        and query (whole, and each fixed piece of a ``{topic}``/``{key}`` template longer than a
        character), for masking in a client's error messages."""
        out = {self.text}
        if self.scheme in ("http", "https"):
            for part in (self.parts.path, self.parts.query):
                out.update(p for p in [part, *re.split(r"\{topic\}|\{key\}", part)] if len(p) > 1)
        if self.parts.password:
            out.add(self.parts.password)
        return sorted(out, key=len, reverse=True)  # the longest first: a piece masks no longer one

    @property
    def options(self) -> dict[str, str]:
        """The URL's query parameters (last one wins)."""
        return dict(parse_qsl(self.parts.query, keep_blank_values=True))

    @property
    def resource(self) -> str:
        """What an AWS URL names (a queue, topic, bus or stream), as given: its case kept."""
        return (self.parts.netloc.rsplit("@", 1)[-1] + self.parts.path).rstrip("/")

    @property
    def kafka_bootstrap(self) -> str:
        """The bootstrap servers of a ``kafka://host:port[,host:port…]`` URL."""
        return self.parts.netloc.rsplit("@", 1)[-1]


def parse_url(text: str, field: str) -> SinkURL:
    """A sink URL, or ConfigError naming ``field`` (without the URL's password)."""
    try:
        parts = urlsplit(text.strip())
    except ValueError as exc:
        raise ConfigError(f"{field}: not a URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES if s != "tls")
        given = f"{scheme}://" if scheme else "(none)"
        raise ConfigError(f"{field}: unknown sink scheme {given}; known: {known}")
    url = SinkURL(scheme, parts, text.strip())
    if scheme == "kafka":
        servers = [s for s in url.kafka_bootstrap.split(",") if s]
        if not servers or not all(_HOST_PORT.match(s) for s in servers) or parts.path not in ("", "/"):
            raise ConfigError(f"{field}: expected kafka://host:port[,host:port...], got {url.display!r}")
        return url
    if scheme in AWS_SCHEMES:
        if parts.username is not None or parts.password is not None:
            raise ConfigError(
                f"{field}: {url.display!r}: AWS credentials never go in the URL; they come from "
                "the standard chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, an "
                "instance or IRSA role)"
            )
        if not re.fullmatch(r"[A-Za-z0-9_.\-/]{1,256}", url.resource) or ":" in parts.netloc:
            raise ConfigError(
                f"{field}: {url.display!r}: expected {scheme}://NAME, the {SCHEMES[scheme].system} "
                "name (letters, digits, '-', '_', '.')"
            )
    if scheme == "pubsub":
        _check_pubsub(url, field)
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise ConfigError(f"{field}: the port of {url.display!r} is not a number from 0 to 65535") from None
    if not parts.hostname:
        raise ConfigError(f"{field}: {url.display!r} names no host")
    allowed = SCHEMES[scheme].options
    if allowed is not None:
        for name, value in url.options.items():
            if name not in allowed:
                raise ConfigError(
                    f"{field}: unknown option {name!r} in {url.display!r}; known: {', '.join(allowed)}"
                )
            if allowed[name] is int and not (value.isdigit() and int(value) > 0):
                raise ConfigError(f"{field}: option {name} must be a positive integer, got {value!r}")
    if scheme in ("redis", "rediss") and parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise ConfigError(
            f"{field}: the database of {url.display!r} must be a number, e.g. redis://host:6379/0"
        )
    return url


def _check_pubsub(url: SinkURL, field: str) -> None:
    """ConfigError naming ``field`` unless ``url`` is ``pubsub://PROJECT/TOPIC``."""
    parts = url.parts
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{field}: {url.display!r}: credentials never go in the URL; they come from Application "
            "Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, the metadata server)"
        )
    project, topic = parts.netloc, parts.path.strip("/")
    if (
        not _PUBSUB_PROJECT.fullmatch(project)
        or not _PUBSUB_TOPIC.fullmatch(topic)
        or topic.lower().startswith("goog")
    ):
        raise ConfigError(
            f"{field}: {url.display!r}: expected pubsub://PROJECT/TOPIC (a project id: 6-30 lowercase "
            "letters, digits and '-'; a topic: 3-255 letters, digits and -_.~+%, starting with a "
            "letter, not with goog)"
        )


@dataclass(frozen=True)
class Route:
    glob: str
    url: SinkURL

    def matches(self, topic: str) -> bool:
        return fnmatchcase(topic, self.glob)

    @property
    def display(self) -> str:
        return f"{self.glob}={self.url.display}"


def parse_route(text: str) -> Route:
    """``GLOB=URL`` as a Route, or ConfigError naming the route (without its password)."""
    glob, sep, url = text.partition("=")
    shown = f"--route {glob.strip()}=..." if sep else f"--route {text.split('://')[0]!r}"
    if not sep or not glob.strip() or not url.strip():
        raise ConfigError(f"{shown}: expected GLOB=URL, e.g. 'orders.*=kafka://kafka:9092'")
    return Route(glob.strip(), parse_url(url, shown))


def parse_routes(items: list[str], kafka_bootstrap: str | None) -> list[Route]:
    """Routes from ``--route`` values (each may hold several, separated by whitespace), then
    ``--kafka-bootstrap`` as the last route ``*=kafka://B``."""
    routes = [parse_route(text) for item in items for text in item.split()]
    if kafka_bootstrap:
        routes.append(Route("*", parse_url(f"kafka://{kafka_bootstrap}", "--kafka-bootstrap")))
    if not routes:
        raise ConfigError("--route (or OUTBOX_ROUTES, or --kafka-bootstrap): no sink to deliver to")
    return routes


def route_for(routes: list[Route], topic: str) -> Route | None:
    """The first route whose glob matches ``topic``, or None."""
    for route in routes:
        if route.matches(topic):
            return route
    return None
