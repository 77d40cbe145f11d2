"""librdkafka's mock cluster (the C library confluent-kafka ships, through ctypes) in a process
of its own: it answers producers as Apache Kafka does, epoch bumps included.

``python -m tests.kafka_mock TOPIC`` makes a one-broker cluster with TOPIC (one partition),
prints its bootstrap address on a line of its own, then takes commands on stdin, one a line:
``down`` (the broker drops its connections and refuses new ones), ``up``; ``no-leader`` (the
partition has no leader: a producer's messages wait in its queue, its connections stay up and
say nothing), ``leader``. It answers each with ``ok``, and ends at the end of its input.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path

import confluent_kafka

BROKER = 1  # the broker's id in a one-broker mock cluster


def _library() -> ctypes.CDLL:
    libs = Path(confluent_kafka.__file__).resolve().parent.parent / "confluent_kafka.libs"
    lib = ctypes.CDLL(str(next(libs.glob("librdkafka*.so*"))))
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
    lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_mock_topic_create.restype = ctypes.c_int
    lib.rd_kafka_mock_topic_create.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    for name in ("rd_kafka_mock_broker_set_down", "rd_kafka_mock_broker_set_up"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.rd_kafka_mock_partition_set_leader.restype = ctypes.c_int
    lib.rd_kafka_mock_partition_set_leader.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_int32,
        ctypes.c_int32,
    ]
    return lib


def main(topic: str) -> None:
    lib = _library()
    error = ctypes.create_string_buffer(512)
    handle = lib.rd_kafka_new(0, lib.rd_kafka_conf_new(), error, len(error))  # a producer handle
    if not handle:
        sys.exit(f"rd_kafka_new: {error.value.decode()}")
    cluster = lib.rd_kafka_mock_cluster_new(handle, 1)
    if not cluster:
        sys.exit("rd_kafka_mock_cluster_new failed")
    if lib.rd_kafka_mock_topic_create(cluster, topic.encode(), 1, 1):
        sys.exit(f"rd_kafka_mock_topic_create {topic} failed")
    print(lib.rd_kafka_mock_cluster_bootstraps(cluster).decode(), flush=True)
    name = topic.encode()
    commands: dict[str, Callable[[], int]] = {
        "down": lambda: lib.rd_kafka_mock_broker_set_down(cluster, BROKER),
        "up": lambda: lib.rd_kafka_mock_broker_set_up(cluster, BROKER),
        "no-leader": lambda: lib.rd_kafka_mock_partition_set_leader(cluster, name, 0, -1),
        "leader": lambda: lib.rd_kafka_mock_partition_set_leader(cluster, name, 0, BROKER),
    }
    for line in sys.stdin:
        command = commands.get(line.strip())
        if command is None:
            print(f"unknown command {line.strip()!r}", flush=True)
            continue
        code = command()
        print("ok" if code == 0 else f"error {code}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
