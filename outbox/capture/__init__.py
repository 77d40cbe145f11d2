"""WAL capture: events written only to the WAL, read from a replication slot.

``mode``: an outbox's capture mode, its slot and publication, switching and the signing key's
rotation; ``wal_message``: one message's format and signature; ``pgoutput``: the stream decoded;
``wal_reader``: the thread that streams a slot; ``write_back``: a WAL batch's commit, its events
stored once their sink answered and the position they reach handed on. This face hands on
``mode``'s names (and the decoder's), as ``outbox.capture`` has always offered them."""

from outbox.capture.mode import (
    FAILOVER_SERVER,
    MIN_SERVER,
    MODES,
    ROTATION_WINDOW,
    CaptureState,
    Rotation,
    check_window,
    prefix_of,
    publication_name,
    rotate_key,
    slot_name,
    slot_names,
    state,
    switch,
)
from outbox.capture.pgoutput import PG_EPOCH, Decoder, Piece, Position, lsn_int, lsn_text

__all__ = [
    "FAILOVER_SERVER", "MIN_SERVER", "MODES", "PG_EPOCH", "ROTATION_WINDOW", "CaptureState", "Decoder",
    "Piece", "Position", "Rotation", "check_window", "lsn_int", "lsn_text", "prefix_of", "publication_name",
    "rotate_key", "slot_name", "slot_names", "state", "switch",
]  # fmt: skip
