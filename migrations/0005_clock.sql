-- One clock for every time comparison: the database's. umbra_now() is now()
-- (the transaction timestamp) plus an optional per-session offset
-- (SET umbra.clock_offset = '90 seconds'), which tests use to travel in time
-- without sleeping. Production never sets it.
CREATE FUNCTION umbra_now() RETURNS timestamptz LANGUAGE sql STABLE AS $$
    SELECT now() + coalesce(nullif(current_setting('umbra.clock_offset', true), ''), '0')::interval
$$;
ALTER TABLE events ALTER COLUMN recorded_at SET DEFAULT umbra_now();
