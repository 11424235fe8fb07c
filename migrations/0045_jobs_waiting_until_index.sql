-- umbra: no transaction
-- The jobs waiting for their time, in the order they fall due: the sweeper reads those due each tick. A
-- partial index, empty in a queue without delayed submissions. Built concurrently, so the queue's writers
-- go on while it reads the table; dropped first if a build that stopped half-way left it invalid.
DROP INDEX CONCURRENTLY IF EXISTS jobs_waiting_until;
CREATE INDEX CONCURRENTLY jobs_waiting_until ON jobs (waiting_until) WHERE status = 'blocked' AND waiting_until IS NOT NULL;
