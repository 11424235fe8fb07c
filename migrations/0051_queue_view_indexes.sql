-- umbra: no transaction
-- The queue view's reads, which every dashboard and every open projections stream makes each time its
-- organization's jobs move, served by index instead of reading the organization's jobs whole (jobs keeps
-- every terminal job for ever, and an organization may have a deep backlog: at 4 million ended and 600,000
-- open jobs each read took 0.6-0.8 s, of one query each):
--
-- * the open jobs listed, running then blocked then queued, each status by priority and submission: one
--   index-ordered scan per status, each stopping at the listing's limit (umbra.api.projections). Queued
--   jobs are read through jobs_claimable, running and blocked ones (few next to the backlog) through the
--   first index here.
-- * the jobs that moved since the stream's last read (position > P, in position order, up to 1,001): the
--   end of the second index, whatever the organization's history.
--
-- Built concurrently, so the queue's writers go on while they read the table; each dropped first if a
-- build that stopped half-way left it invalid.
DROP INDEX CONCURRENTLY IF EXISTS jobs_running_and_blocked_listed;
CREATE INDEX CONCURRENTLY jobs_running_and_blocked_listed ON jobs (organization_id, status, priority, seq)
    WHERE status IN ('running', 'blocked');
DROP INDEX CONCURRENTLY IF EXISTS jobs_by_position;
CREATE INDEX CONCURRENTLY jobs_by_position ON jobs (organization_id, position);
