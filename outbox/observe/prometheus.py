"""Prometheus metric types, without a client library: a sidecar needs a handful of kinds
(counters, gauges, histograms with fixed buckets) and the text format, not a framework."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence

from outbox.escape import escape

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    """A label value in the text format: control characters as outbox.escape writes them (a topic
    is a writer's text, and /metrics is read in terminals too), then the format's own escapes."""
    value = escape(value)
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[Labels, float] = {}

    def inc(self, labels: Labels = (), amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, labels: Labels = ()) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.labels:
            items = [((), 0.0)]  # an unlabelled counter exists from the start: 0, not absent
        return self.header() + [f"{self.name}{_fmt_labels(self.labels, k)} {_num(v)}" for k, v in items]


class Gauge(Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[Labels, float] = {}

    def set(self, value: float, labels: Labels = ()) -> None:
        with self._lock:
            self._values[labels] = value

    def replace(self, values: dict[Labels, float]) -> None:
        """Set every series at once (series absent from ``values`` disappear)."""
        with self._lock:
            self._values = dict(values)

    def replace_where(self, position: int, value: str, values: dict[Labels, float]) -> None:
        """Set every series whose label at ``position`` is ``value`` (those absent from ``values``
        disappear); the other series stay: one outbox's topics, say."""
        with self._lock:
            kept = {k: v for k, v in self._values.items() if k[position] != value}
            self._values = {**kept, **values}

    def forget(self, position: int, value: str) -> None:
        """Drop every series whose label at ``position`` is ``value`` (an outbox no longer served)."""
        with self._lock:
            self._values = {k: v for k, v in self._values.items() if k[position] != value}

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_fmt_labels(self.labels, k)} {_num(v)}" for k, v in items]


class Histogram(Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        # labels -> [count per bucket (+Inf last), sum, count]
        self._series: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe_many(self, values: Iterable[float], labels: Labels = ()) -> None:
        with self._lock:
            series = self._series.get(labels)
            if series is None:
                series = self._series[labels] = ([0] * (len(self.buckets) + 1), [0.0, 0.0])
            counts, totals = series
            for v in values:
                counts[bisect.bisect_left(self.buckets, v)] += 1
                totals[0] += v
                totals[1] += 1

    def observe(self, value: float, labels: Labels = ()) -> None:
        self.observe_many((value,), labels)

    @property
    def count(self) -> int:
        return int(sum(totals[1] for _, totals in self._series.values()))

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(c), list(t))) for k, (c, t) in self._series.items())
        if not items and not self.labels:
            items = [((), ([0] * (len(self.buckets) + 1), [0.0, 0.0]))]
        lines = self.header()
        for labels, (counts, (total, n)) in items:
            cumulative = 0
            for bound, c in zip(self.buckets, counts, strict=False):
                cumulative += c
                le = f'le="{_num(bound)}"'
                lines.append(f"{self.name}_bucket{_fmt_labels(self.labels, labels, le)} {cumulative}")
            inf = 'le="+Inf"'
            lines.append(f"{self.name}_bucket{_fmt_labels(self.labels, labels, inf)} {int(n)}")
            lines.append(f"{self.name}_sum{_fmt_labels(self.labels, labels)} {_num(total)}")
            lines.append(f"{self.name}_count{_fmt_labels(self.labels, labels)} {int(n)}")
        return lines
