-- Job counts by organization and status, kept exact by triggers on jobs: the queue view, its stream and
-- GET /metrics read them instead of counting every row of jobs, which keeps its terminal jobs for ever
-- (at 3 million jobs one count took 0.8-0.9 s, at 6 million every scrape timed out).
--
-- Why triggers, not deltas written by the statements that write jobs (projections/jobs.py): they see
-- every write of a row whoever sends it (a server of the previous version during an upgrade, a migration,
-- an operator's UPDATE), and each row's old version exactly as the statement replaced it, which a
-- statement joining jobs to itself reads from its snapshot (under READ COMMITTED an older version than the
-- row it then locks and updates). They are statement-level, with transition tables: one aggregate per
-- statement, not one call per row (a batch submit writes 10,000 rows in one statement, by COPY or not), and
-- a statement whose rows all keep their status and flags (lease renewals) writes no counter row at all.
--
-- One row per (organization, status), not shards of it: every transaction of the service that writes jobs
-- rows has appended their events first, in the same transaction, and an append takes the log's ordering
-- lock and holds it until commit (umbra.events.store). A counter row is therefore only ever locked by a
-- transaction that already holds that lock, and released with it: two such writers never meet on a
-- counter row, whatever they count, and a hot row (every claim moves queued to running) makes none wait
-- longer than the log already does. Shards would cost every read a sum and buy nothing. Only a writer
-- without an append (an operator's UPDATE of jobs) can hold a counter row while holding no ordering lock;
-- the service's next write of that organization and status then waits for it, as it would for the jobs
-- rows such a writer holds.
--
-- Tenancy as for every other per-organization table: the organization's id is a column every read filters
-- by (umbra.projections.job_counts). The triggers run with the writer's rights: the service role is
-- granted the table like the other projection tables (0006's default privileges; granted again here for a
-- database migrated by another role since).

CREATE TABLE job_counts (
    organization_id       uuid NOT NULL REFERENCES organizations (id),
    status                text NOT NULL,
    -- jobs of this status; of them, those waiting for the jobs they depend on; those waiting for a moment
    jobs                  bigint NOT NULL DEFAULT 0,
    awaiting_dependencies bigint NOT NULL DEFAULT 0,
    delayed               bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (organization_id, status)
);
GRANT SELECT, INSERT, UPDATE, DELETE ON job_counts TO umbra_service;

-- The triggers' one function: each statement's rows added to (inserted, new versions) and taken from (old
-- versions, deleted) their organization and status. Each branch reads only the transition tables its own
-- trigger declares. Deltas are added in key order; a group whose rows cancel out (a renewal: running to
-- running) touches no counter row.
CREATE FUNCTION umbra_count_jobs() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, public AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO job_counts AS c (organization_id, status, jobs, awaiting_dependencies, delayed)
        SELECT organization_id, status, sum(n), sum(a), sum(w)
        FROM (SELECT organization_id, status, 1 AS n, awaiting_dependencies::int AS a, (waiting_until IS NOT NULL)::int AS w FROM new_rows) AS changes
        GROUP BY organization_id, status HAVING sum(n) <> 0 OR sum(a) <> 0 OR sum(w) <> 0
        ORDER BY organization_id, status
        ON CONFLICT (organization_id, status) DO UPDATE
        SET jobs = c.jobs + EXCLUDED.jobs, awaiting_dependencies = c.awaiting_dependencies + EXCLUDED.awaiting_dependencies,
            delayed = c.delayed + EXCLUDED.delayed;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO job_counts AS c (organization_id, status, jobs, awaiting_dependencies, delayed)
        SELECT organization_id, status, sum(n), sum(a), sum(w)
        FROM (SELECT organization_id, status, 1 AS n, awaiting_dependencies::int AS a, (waiting_until IS NOT NULL)::int AS w FROM new_rows
                  UNION ALL
              SELECT organization_id, status, -1 AS n, -awaiting_dependencies::int AS a, -(waiting_until IS NOT NULL)::int AS w FROM old_rows) AS changes
        GROUP BY organization_id, status HAVING sum(n) <> 0 OR sum(a) <> 0 OR sum(w) <> 0
        ORDER BY organization_id, status
        ON CONFLICT (organization_id, status) DO UPDATE
        SET jobs = c.jobs + EXCLUDED.jobs, awaiting_dependencies = c.awaiting_dependencies + EXCLUDED.awaiting_dependencies,
            delayed = c.delayed + EXCLUDED.delayed;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO job_counts AS c (organization_id, status, jobs, awaiting_dependencies, delayed)
        SELECT organization_id, status, sum(n), sum(a), sum(w)
        FROM (SELECT organization_id, status, -1 AS n, -awaiting_dependencies::int AS a, -(waiting_until IS NOT NULL)::int AS w FROM old_rows) AS changes
        GROUP BY organization_id, status HAVING sum(n) <> 0 OR sum(a) <> 0 OR sum(w) <> 0
        ORDER BY organization_id, status
        ON CONFLICT (organization_id, status) DO UPDATE
        SET jobs = c.jobs + EXCLUDED.jobs, awaiting_dependencies = c.awaiting_dependencies + EXCLUDED.awaiting_dependencies,
            delayed = c.delayed + EXCLUDED.delayed;
    ELSE  -- TRUNCATE
        DELETE FROM job_counts;
    END IF;
    RETURN NULL;
END $$;

-- Backfilled from the rows as they are, with no writer between the count and the triggers: the lock is
-- the one CREATE TRIGGER takes, taken first (writers wait for the count: seconds on millions of jobs).
LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE;
CREATE TRIGGER jobs_counted_insert AFTER INSERT ON jobs REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION umbra_count_jobs();
CREATE TRIGGER jobs_counted_update AFTER UPDATE ON jobs REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION umbra_count_jobs();
CREATE TRIGGER jobs_counted_delete AFTER DELETE ON jobs REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION umbra_count_jobs();
CREATE TRIGGER jobs_counted_truncate AFTER TRUNCATE ON jobs
    FOR EACH STATEMENT EXECUTE FUNCTION umbra_count_jobs();
INSERT INTO job_counts (organization_id, status, jobs, awaiting_dependencies, delayed)
SELECT organization_id, status, count(*), count(*) FILTER (WHERE awaiting_dependencies),
       count(*) FILTER (WHERE waiting_until IS NOT NULL)
FROM jobs GROUP BY organization_id, status;
