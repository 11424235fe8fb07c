-- A claim judges the memory its node last reported free. A job the node took
-- since that report is not in it yet, so a second claim (two agents on one
-- node, one job claimed after another between two beats) could place a
-- second 16,000 MB job on a 24,000 MB card already promised to the first.
-- The claim path now reserves the memory of such jobs; it needs to know when
-- each running job was claimed, and to find a node's running jobs that take
-- memory without walking every running job.
--
-- claimed_at: the time of the job's latest job.claimed (the fold sets it).
-- Jobs running now get theirs from the log.
ALTER TABLE jobs ADD COLUMN claimed_at timestamptz;

UPDATE jobs SET claimed_at = (
    SELECT max(e.recorded_at) FROM events e WHERE e.stream = 'job:' || jobs.id::text AND e.type = 'job.claimed'
)
WHERE status = 'running';

-- Only jobs that take memory where they run (a model, or a floor): a job with
-- no requirement, the bulk of a no-op queue, adds no entry at its claim.
CREATE INDEX jobs_held_taking_memory ON jobs (lease_owner, claimed_at)
WHERE status = 'running' AND (requires ? 'models' OR requires ? 'vram_min_mb' OR requires ? 'ram_min_mb');
