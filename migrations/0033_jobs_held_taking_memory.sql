-- A claim judges the memory its node last reported free, and a job the node
-- took since that report is not in it: a second claim (two agents on one
-- node, an agent's claims between two beats) could place a second 16,000 MB
-- job on a 24,000 MB card already promised to the first. So a claim now
-- reads the node's running jobs that take memory, and the memory they are
-- promised bounds what it may place (umbra.domain.placement.with_running_jobs).
--
-- Only jobs that take memory where they run (a model, or a floor): a job with
-- no requirement, the bulk of a no-op queue, adds no entry at its claim, and
-- the read finds nothing for a node that runs only such jobs.
CREATE INDEX jobs_held_taking_memory ON jobs (lease_owner)
WHERE status = 'running' AND (requires ? 'models' OR requires ? 'vram_min_mb' OR requires ? 'ram_min_mb');
