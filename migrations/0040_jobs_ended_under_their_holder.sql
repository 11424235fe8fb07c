-- Whether a job ended while its holder ran it, without the holder's word: cancelled while running, or
-- failed by the controller past its max_runtime_s. Its handler runs on until its agent hears of it (its
-- next renewal), and its memory with it: the claims count such a job's memory on its node until the
-- node next reports its devices (as migration 0035 did for cancelled jobs alone), and a failure report
-- from that holder is no repeat of its own.
ALTER TABLE jobs ADD COLUMN ended_under_holder boolean NOT NULL DEFAULT false;
-- As the fold has it: cancelled with its holder kept (it was running), or failed, last, by the controller
-- past its max_runtime_s (the job's last event says so; the row does not).
UPDATE jobs SET ended_under_holder = true WHERE status = 'cancelled' AND lease_owner IS NOT NULL;
-- The log is read only for failed jobs that kept a holder and had a limit: what such a failure always has.
UPDATE jobs j SET ended_under_holder = true
WHERE j.status = 'failed' AND j.lease_owner IS NOT NULL AND j.requires ? 'max_runtime_s' AND (
    SELECT e.type = 'job.failed' AND e.data ->> 'reason' = 'runtime_exceeded' FROM events e
    WHERE e.stream = 'job:' || j.id::text ORDER BY e.version DESC LIMIT 1
);
DROP INDEX jobs_cancelled_taking_memory;
CREATE INDEX jobs_ended_under_holder_taking_memory ON jobs (lease_owner, finished_at)
WHERE ended_under_holder AND lease_owner IS NOT NULL AND placement IS NOT NULL
  AND (requires ? 'models' OR requires ? 'vram_min_mb' OR requires ? 'ram_min_mb');
