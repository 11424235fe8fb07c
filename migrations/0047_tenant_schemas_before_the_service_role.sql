-- Organizations created before 0006 got their tenant schema from 0002's create_tenant_schema, which
-- granted nothing to umbra_service (the role did not exist yet), and 0006 granted it only what was in
-- public. Their projects were out of the service's reach: a submission naming one failed with
-- "permission denied for schema tenant_..." (a 500) instead of being checked. Each such schema now gets
-- what create_tenant_schema has granted since 0006; granted again to later ones, it changes nothing.
DO $$
DECLARE
    schema_name text;
BEGIN
    FOR schema_name IN
        SELECT n.nspname FROM organizations o
        JOIN pg_namespace n ON n.nspname = 'tenant_' || replace(o.id::text, '-', '')
    LOOP
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO umbra_service', schema_name);
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON %I.projects TO umbra_service', schema_name);
    END LOOP;
END $$;
