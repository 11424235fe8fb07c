-- umbra: no transaction
-- The waiting jobs, which the sweeper looks at every tick: a partial index, empty in a queue without
-- dependencies. Built concurrently, so the queue's writers go on while it reads the table; dropped first
-- if a build that stopped half-way left it invalid.
DROP INDEX CONCURRENTLY IF EXISTS jobs_awaiting_dependencies;
CREATE INDEX CONCURRENTLY jobs_awaiting_dependencies ON jobs (id) WHERE awaiting_dependencies;
