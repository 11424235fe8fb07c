-- Delayed submissions: waiting_until is the not_before a job was submitted with while it waits for it
-- (blocked until then; NULL for every other job). Added without rewriting the table (no default); the
-- index the sweeper finds due jobs by is built by 0045, concurrently.
ALTER TABLE jobs ADD COLUMN waiting_until timestamptz;
