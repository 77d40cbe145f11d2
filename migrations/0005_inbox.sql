-- outbox 0005: the consumer inbox (outbox.inbox.first_delivery).
--
-- One row per (consumer, event id) a consumer has handled, written in the
-- consumer's own transaction together with the handler's effect: a duplicate
-- delivery finds the row and is skipped; a rolled-back handler leaves no row.
-- It may live in another database than the outbox (the consumer's own):
-- `outbox migrate --inbox-only` applies only this part there.
-- event_id is text, not uuid: every sink carries the outbox's event id, but a
-- consumer may also record ids of messages from other producers.
CREATE TABLE {schema}.inbox (
    consumer    text        NOT NULL,
    event_id    text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- `outbox inbox prune --older-than 7d` deletes by age, in chunks.
CREATE INDEX inbox_received_at_idx ON {schema}.inbox (received_at);
