-- A claim may name the job kinds it takes (an agent claims only the kinds it has
-- handlers for), so a queue shape is now a job's kind and its requirements together.
-- Keyed by kind first, the index lists an organization's distinct queued (kind,
-- requirements) pairs with one descent each, exactly as it listed requirements
-- before, and walks each pair's rows in (priority, seq) order: a claimer that
-- takes only some kinds never visits the rows of the others, however many are
-- queued in front. With the kind as a filter instead, a node that handles one
-- kind would read every queued job of every other kind on each claim.
DROP INDEX jobs_by_shape;
CREATE INDEX jobs_by_shape ON jobs (organization_id, kind, requires, priority, seq) WHERE status = 'queued';

-- Each shape as the JSON text of [kind, requirements]: one value, so callers keep a
-- shape as one string (a key, an element of a text[] parameter) and split it in SQL.
-- Sorting stays disabled while the body is planned (see 0025): the skip scan is
-- the only plan without a sort.
CREATE OR REPLACE FUNCTION umbra_queued_shapes(org uuid, max_shapes integer) RETURNS SETOF text
    LANGUAGE plpgsql STABLE SET enable_sort = off AS $$
BEGIN
    RETURN QUERY
    WITH RECURSIVE shapes(kind, requires) AS (
        (SELECT j.kind, j.requires FROM jobs j WHERE j.organization_id = org AND j.status = 'queued'
         ORDER BY j.kind, j.requires LIMIT 1)
      UNION ALL
        SELECT later.kind, later.requires FROM shapes s CROSS JOIN LATERAL (
            SELECT j.kind, j.requires FROM jobs j
            WHERE j.organization_id = org AND j.status = 'queued' AND (j.kind, j.requires) > (s.kind, s.requires)
            ORDER BY j.kind, j.requires LIMIT 1
        ) later
    )
    SELECT jsonb_build_array(shapes.kind, shapes.requires)::text FROM shapes LIMIT max_shapes;
END $$;
