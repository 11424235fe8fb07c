-- The pairing rate limit counts a sliding window: the attempts of the last
-- 15 minutes, whenever they fell. pairing_attempts counted fixed windows, so
-- a source could spend its whole budget just before a window's end and again
-- just after it: twice the budget within seconds.
--
-- One row per source holds the times of its admitted attempts still within
-- the window, oldest first (never more than the budget); a refused attempt
-- adds no time, so Retry-After is exact: when the oldest leaves the window,
-- one more attempt is admitted. The row's lock (INSERT ... ON CONFLICT DO
-- UPDATE) orders concurrent attempts of one source, so none is lost.
--
-- pairing_attempts stays for servers of the previous version during a rolling
-- upgrade; nothing of this version reads or writes it.
CREATE TABLE pairing_attempt_times (
    source       text PRIMARY KEY,
    attempted_at timestamptz[] NOT NULL,
    refused      boolean NOT NULL DEFAULT false
);
COMMENT ON COLUMN pairing_attempt_times.attempted_at IS 'admitted attempts within the window, oldest first';
COMMENT ON COLUMN pairing_attempt_times.refused IS 'whether the source''s latest attempt was refused';
