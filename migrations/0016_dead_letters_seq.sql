-- outbox 0016: dead letters in the order they were made (issue 43).
--
-- The console's bulk actions ("redrive all…") act only on the dead letters its page showed:
-- those up to the page's high-water mark. The mark was the highest dead-letter id, but a dead
-- letter keeps its event's id, so an older event dead-lettered after the page loaded fell
-- under the mark and was taken along. `seq` numbers dead letters as they are made (a redrive
-- and a new death make a new one); the mark is max(seq). Filled for the rows already here.
ALTER TABLE {schema}.dead_letters ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY;
CREATE INDEX dead_letters_seq_idx ON {schema}.dead_letters (seq);
