-- Planner statistics of the queue, refreshed by the service when the table has
-- outgrown them (umbra.compute.statistics). Only a table's owner may ANALYZE it,
-- and the service runs as umbra_service: this function runs with its owner's
-- rights (SECURITY DEFINER) and does nothing else.
CREATE FUNCTION umbra_analyze_jobs() RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
BEGIN
    ANALYZE public.jobs;
END $$;
GRANT EXECUTE ON FUNCTION umbra_analyze_jobs() TO umbra_service;
