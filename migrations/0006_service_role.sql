-- The role the service's request connections run as (SET ROLE umbra_service):
-- it may read and append events but never rewrite them, whatever the login role
-- is allowed. Roles are cluster-wide, so creation tolerates a role made by
-- another database's migration (or a concurrent one). It is made only when it
-- does not exist: PostgreSQL checks the right to create a role before whether
-- it exists, and an owner without CREATEROLE, for whom it was made beforehand
-- (README), failed here. (Where this ran already, the guard changes nothing.)
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'umbra_service') THEN
        CREATE ROLE umbra_service NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;
END $$;

GRANT USAGE ON SCHEMA public TO umbra_service;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO umbra_service;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO umbra_service;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO umbra_service;
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO umbra_service;
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT USAGE, SELECT ON SEQUENCES TO umbra_service;

-- The log is append-only for the service.
REVOKE UPDATE, DELETE, TRUNCATE ON events FROM umbra_service;
REVOKE UPDATE, DELETE, TRUNCATE ON schema_migrations FROM umbra_service;

-- Tenant schemas are created through this one function, run with its owner's
-- rights (SECURITY DEFINER), so the service role needs no CREATE on the
-- database; the schema name is derived from the id, never supplied.
CREATE OR REPLACE FUNCTION create_tenant_schema(org uuid) RETURNS text
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    schema_name text := 'tenant_' || replace(org::text, '-', '');
BEGIN
    EXECUTE format('CREATE SCHEMA %I', schema_name);
    EXECUTE format($f$CREATE TABLE %I.projects (
        id         uuid PRIMARY KEY,
        name       text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
        created_at timestamptz NOT NULL DEFAULT now()
    )$f$, schema_name);
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO umbra_service', schema_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON %I.projects TO umbra_service', schema_name);
    RETURN schema_name;
END $$;
