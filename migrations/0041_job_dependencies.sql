-- Jobs that run after others: depends_on names the jobs a job waits for (NULL: none; written once, at
-- submission), and awaiting_dependencies whether it still waits for them (blocked until every one
-- completes, failed as soon as one ends otherwise). The sweeper reads the waiting ones by the partial
-- index, which is empty in a queue without dependencies.
ALTER TABLE jobs ADD COLUMN depends_on uuid[];
ALTER TABLE jobs ADD COLUMN awaiting_dependencies boolean NOT NULL DEFAULT false;
CREATE INDEX jobs_awaiting_dependencies ON jobs (id) WHERE awaiting_dependencies;
