-- The sweeper announces delayed jobs (retry backoff, lease-expiry delay) the
-- moment their not_before passes, so waiting long-polls wake without polling.
-- It asks "which queued jobs became due since the last tick" every second;
-- this partial index keeps that a range scan over the few delayed jobs instead
-- of a walk over the whole queue.
CREATE INDEX jobs_delayed ON jobs (not_before) WHERE status = 'queued' AND not_before IS NOT NULL;
