-- The queue's statistics are refreshed by the sweeper (umbra.compute.statistics). A plain ANALYZE waits
-- for the table's SHARE UPDATE EXCLUSIVE lock, which a manual VACUUM or CREATE INDEX CONCURRENTLY holds
-- for minutes (claims and reports are not held up by it): the sweeper's tick, and every lease recovery
-- behind it, waited as long. With SKIP_LOCKED the analysis is left for a later tick instead.
CREATE OR REPLACE FUNCTION umbra_analyze_jobs() RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
BEGIN
    ANALYZE (SKIP_LOCKED) public.jobs;
END $$;
