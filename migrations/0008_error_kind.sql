-- outbox 0008: the kind of an event's last failure (a sink's short, stable error name).
--
-- "unavailable", "timeout", Kafka's "_MSG_TIMED_OUT" … say the sink could not be reached;
-- when it answers again, the relay retries those events at once instead of waiting out
-- their backoff. Refusals for the event's own reasons keep their schedule.
ALTER TABLE {schema}.events ADD COLUMN last_error_kind text;
