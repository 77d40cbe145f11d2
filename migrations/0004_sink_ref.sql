-- outbox 0004: the archive keeps a sink's own message reference.
--
-- Kafka coordinates fit sink_partition / sink_offset. Other sinks name what they
-- stored differently: a Redis Streams entry id ("1700000000000-0"), a NATS
-- JetStream stream name (its sequence goes to sink_offset). sink_ref holds it.
ALTER TABLE {schema}.delivered ADD COLUMN sink_ref text;
