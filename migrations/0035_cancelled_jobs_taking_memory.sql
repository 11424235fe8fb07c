-- A job cancelled while it ran keeps running on its node until its agent
-- hears of the cancel, at its next renewal (a third of the lease, 20 s by
-- default), and its handler stops: until then its model and buffers hold the
-- device's memory. Claims stopped counting the job at the cancel, and the
-- node's last report, made before the cancel, could be from before the job
-- loaded anything: a claim could place a second 16,000 MB job on a 24,000 MB
-- card the cancelled one still filled.
--
-- Such a job's memory now stays promised until the node next reports its
-- devices: that report shows what the handler still holds, if anything. The
-- report's time is kept apart from last_seen_at, which a beat without devices
-- also moves. NULL: no report since this column came; last_seen_at stands
-- in (a node that never reports its devices has no later figure to trust).
ALTER TABLE node_liveness ADD COLUMN reported_at timestamptz;
COMMENT ON COLUMN node_liveness.reported_at IS 'when the last beat that reported devices arrived';

-- The running jobs' partial index (jobs_held_taking_memory) for the jobs
-- cancelled while they ran: the claim reads those cancelled since the node's
-- last report, a range at the end of the node's entries.
CREATE INDEX jobs_cancelled_taking_memory ON jobs (lease_owner, finished_at)
WHERE status = 'cancelled' AND lease_owner IS NOT NULL AND placement IS NOT NULL
  AND (requires ? 'models' OR requires ? 'vram_min_mb' OR requires ? 'ram_min_mb');
