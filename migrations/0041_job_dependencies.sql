-- Jobs that run after others: depends_on names the jobs a job waits for (NULL: none; written once, at
-- submission), and awaiting_dependencies whether it still waits for them (blocked until every one
-- completes, failed as soon as one ends otherwise). Both are added without rewriting the table (a
-- constant default); the index the sweeper reads them by is built by 0042, concurrently.
ALTER TABLE jobs ADD COLUMN depends_on uuid[];
ALTER TABLE jobs ADD COLUMN awaiting_dependencies boolean NOT NULL DEFAULT false;
