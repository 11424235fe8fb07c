-- The (kind, requirements) shapes get a function of their own name, and
-- umbra_queued_shapes answers requirements again, as before 0029. Servers of the
-- previous version, still running during a rolling upgrade, call it and decode
-- each row as requirements; 0029 had it return [kind, requirements] pairs, which
-- they cannot read. Without the index's order it now sorts (slower, still right)
-- until no such server runs; the current code calls umbra_queued_kind_shapes.
CREATE FUNCTION umbra_queued_kind_shapes(org uuid, max_shapes integer) RETURNS SETOF text
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

CREATE OR REPLACE FUNCTION umbra_queued_shapes(org uuid, max_shapes integer) RETURNS SETOF text
    LANGUAGE plpgsql STABLE SET enable_sort = off AS $$
BEGIN
    RETURN QUERY
    WITH RECURSIVE shapes(requires) AS (
        (SELECT j.requires FROM jobs j WHERE j.organization_id = org AND j.status = 'queued'
         ORDER BY j.requires LIMIT 1)
      UNION ALL
        SELECT (SELECT j.requires FROM jobs j
                WHERE j.organization_id = org AND j.status = 'queued' AND j.requires > s.requires
                ORDER BY j.requires LIMIT 1)
        FROM shapes s WHERE s.requires IS NOT NULL
    )
    SELECT shapes.requires::text FROM shapes WHERE shapes.requires IS NOT NULL LIMIT max_shapes;
END $$;
