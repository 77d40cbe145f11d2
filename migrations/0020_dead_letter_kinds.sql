-- outbox 0020: a dead letter keeps the kind of its error (issue 56).
--
-- WAL capture dead-letters a message under the outbox's prefix that no writer of the outbox
-- signed (unsigned_event: any role may emit one) or that is no event's encoding (corrupt_event),
-- so that nothing is lost and nothing of a stranger's is delivered. A bulk redrive put those back
-- into the events table like any other, and a catch-all route then delivered the stranger's
-- content. The kind is now kept, and redrive takes these two only by id, with an explicit flag
-- (`outbox dead redrive --ids N --include-unverified`). The dead letters already here get theirs
-- from the reasons the relay gave them.
ALTER TABLE {schema}.dead_letters ADD COLUMN kind text;
UPDATE {schema}.dead_letters SET kind = 'unsigned_event'
WHERE topic = '(unsigned)' AND error LIKE 'a WAL message under % whose signature does not verify%';
UPDATE {schema}.dead_letters SET kind = 'corrupt_event'
WHERE kind IS NULL AND (error LIKE 'a signed WAL message that is no outbox event:%'
                        OR error LIKE 'corrupt event row:%');
