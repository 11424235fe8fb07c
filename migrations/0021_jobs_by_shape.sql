-- Claimable jobs by requirement shape. jobs_claimable walks the queue in claim
-- order, so a node that cannot run the work in front (a CPU node behind GPU
-- jobs) walks every entry of it on each claim. Keyed by shape first, this index
-- lets a claim list the organization's distinct queued shapes with one descent
-- each (a skip scan), judge each shape once, and read only the heads of the
-- shapes it can run, in (priority, seq) order within each: the work in front
-- that the node cannot run is never visited. jobs_claimable stays: it is the
-- claim's ordered scan when an organization has too many distinct shapes to
-- judge them all (umbra.compute.claims), and explain's count of the jobs ahead.
CREATE INDEX jobs_by_shape ON jobs (organization_id, requires, priority, seq) WHERE status = 'queued';
