-- umbra: no transaction
-- Which waiting jobs depend on a given job: the sweeper's prompt look, run when jobs end, reads only the
-- dependents of the jobs whose streams moved (depends_on && their ids) instead of every waiting job. A partial
-- GIN index, empty in a queue without dependencies; built concurrently, dropped first if a stopped build left
-- it invalid.
DROP INDEX CONCURRENTLY IF EXISTS jobs_waiting_on;
CREATE INDEX CONCURRENTLY jobs_waiting_on ON jobs USING gin (depends_on) WHERE awaiting_dependencies;
