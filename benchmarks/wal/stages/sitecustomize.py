"""Stage timing for ``outbox bench --scenarios steady`` (a measurement harness, not the product).

Put this directory on PYTHONPATH and set OUTBOX_TRACE=<dir>: every process of the bench then
records, for each event whose id ends in 0 (a sixteenth), when it was read from the slot
(``read``), taken by the loop (``take``), when its batch's claim or key check started
(``start``), when it was produced (``produce``) and when its ack was served (``ack``), in
<dir>/trace-<pid>.txt; the writers' commit times go to <dir>/commits-<pid>.txt.
OUTBOX_TRACE_LOOP=1 also times the relay loop's calls (<dir>/loop-<pid>.txt).
OUTBOX_EXP_LINGER sets the producer's ``linger.ms``. OUTBOX_EXP_SLICE and OUTBOX_EXP_SENDNOW
set ``outbox.relay.REPORT_SLICE`` and ``outbox.sinks.kafka.SEND_NOW_SLICE``, the constants of
two changes that were measured and not kept (results.md describes them): with the shipped code
they do nothing.
"""

from __future__ import annotations

import builtins
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

TRACE = os.environ.get("OUTBOX_TRACE", "")
_lock = threading.Lock()
_files: dict[str, Any] = {}


def _write(kind: str, line: str) -> None:
    with _lock:
        f = _files.get(kind)
        if f is None:
            f = _files[kind] = open(os.path.join(TRACE, f"{kind}-{os.getpid()}.txt"), "a", buffering=1)
        f.write(line)


def _rec(stage: str, ids: list[str], at: float | None = None) -> None:
    at = time.time() if at is None else at
    _write("trace", "".join(f"{stage} {i} {at:.6f}\n" for i in ids if i.endswith("0")))


def _capture(capture: Any) -> None:
    feed, take = capture.Decoder.feed, capture.WalReader.take

    def timed_feed(self: Any, data: bytes) -> Any:
        piece = feed(self, data)
        if piece is not None and piece.rows:
            _rec("read", [str(r[1]) for r in piece.rows])
        return piece

    def timed_take(self: Any, limit: int) -> Any:
        taken = take(self, limit)
        if taken is not None:
            _rec("take", [str(r[1]) for r in taken[0]])
        return taken

    capture.Decoder.feed, capture.WalReader.take = timed_feed, timed_take


def _span(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _write("loop", f"{name} {start:.6f} {time.time():.6f}\n")

    return timed


def _relay(relay: Any) -> None:
    send = relay.Relay._send

    def timed_send(self: Any, lane: Any, batch: Any, claim_start: int, limit: int) -> int:
        ids = [str(e.event_id) for e in batch.events if e is not None]
        _rec("start", ids, claim_start / 1e9)
        _rec("produce", ids)
        return int(send(self, lane, batch, claim_start, limit))

    relay.Relay._send = timed_send
    if os.environ.get("OUTBOX_TRACE_LOOP"):
        names = (
            "_finish_complete_batches",
            "_read_and_send",
            "_claim_and_send",
            "_heartbeat",
            "_step",
            "_record",
        )
        for name in names:
            setattr(relay.Relay, name, _span(name, getattr(relay.Relay, name)))
    if os.environ.get("OUTBOX_EXP_SLICE") and hasattr(relay, "REPORT_SLICE"):
        relay.REPORT_SLICE = float(os.environ["OUTBOX_EXP_SLICE"])


def _batch(batch: Any) -> None:
    if os.environ.get("OUTBOX_TRACE_LOOP"):
        batch.Batch.finish = _span("Batch.finish", batch.Batch.finish)
        for cls in (batch.Batch, batch.WalBatch):
            name = f"{cls.__name__}._write_and_commit"
            cls._write_and_commit = _span(name, cls.__dict__["_write_and_commit"])


def _kafka(kafka: Any) -> None:
    if os.environ.get("OUTBOX_TRACE_LOOP"):
        for name in ("poll", "flush", "produce_many"):
            setattr(kafka.KafkaSink, name, _span("kafka." + name, getattr(kafka.KafkaSink, name)))
    if os.environ.get("OUTBOX_EXP_SENDNOW") and hasattr(kafka, "SEND_NOW_SLICE"):
        kafka.SEND_NOW_SLICE = float(os.environ["OUTBOX_EXP_SENDNOW"])
    if os.environ.get("OUTBOX_EXP_LINGER"):
        kafka.DEFAULT_CONFIG["linger.ms"] = float(os.environ["OUTBOX_EXP_LINGER"])


def _contenders(contenders: Any) -> None:
    setitem, timed = contenders._TimedSlots.__setitem__, contenders.AckTimingSink._timed

    def acked_slot(self: Any, index: int, outcome: Any) -> None:
        _rec("ack", [str(self.events[index].event_id)])
        setitem(self, index, outcome)

    def acked_report(self: Any, event: Any, report: Any) -> Any:
        inner, event_id = timed(self, event, report), str(event.event_id)

        def report_acked(outcome: Any) -> None:
            _rec("ack", [event_id])
            inner(outcome)

        return report_acked

    contenders._TimedSlots.__setitem__ = acked_slot
    contenders.AckTimingSink._timed = acked_report


def _workspace(workspace: Any) -> None:
    join = workspace.Writers.join

    def join_and_keep(self: Any) -> dict[str, float]:
        commits: dict[str, float] = join(self)
        _write("commits", "".join(f"commit {k} {v:.6f}\n" for k, v in commits.items()))
        return commits

    workspace.Writers.join = join_and_keep


# module -> (a name it defines once loaded, its patch)
_PATCHES: dict[str, tuple[str, Callable[[Any], None]]] = {
    "outbox.capture": ("WalReader", _capture),
    "outbox.relay": ("Relay", _relay),
    "outbox.batch": ("WalBatch", _batch),
    "outbox.sinks.kafka": ("SEND_NOW_WAIT", _kafka),
    "outbox.bench.contenders": ("AckTimingSink", _contenders),
    "outbox.bench.workspace": ("Writers", _workspace),
}

if TRACE:
    _import = builtins.__import__

    def _patching_import(name: str, *args: Any, **kwargs: Any) -> Any:
        module = _import(name, *args, **kwargs)
        for mod, (defined, patch) in list(_PATCHES.items()):
            loaded = sys.modules.get(mod)
            if loaded is not None and hasattr(loaded, defined):
                del _PATCHES[mod]
                patch(loaded)
        if not _PATCHES:
            builtins.__import__ = _import
        return module

    builtins.__import__ = _patching_import
