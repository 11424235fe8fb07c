-- Organizations are tenants. Projects live in a per-tenant schema
-- (tenant_<org id hex>) created with the organization, so a project lookup is
-- addressed by explicit schema name and cannot see another tenant's rows.
CREATE TABLE organizations (
    id         uuid PRIMARY KEY,
    name       text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- API keys for submitters, dashboards, auditors and administrators. Only an
-- argon2id hash is stored; the prefix narrows the lookup but never decides it
-- (several keys may share one, each candidate's hash is verified).
CREATE TABLE api_keys (
    id              uuid PRIMARY KEY,
    organization_id uuid NOT NULL REFERENCES organizations (id),
    prefix          text NOT NULL,
    secret_hash     text NOT NULL,
    scopes          text[] NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    revoked_at      timestamptz
);
CREATE INDEX api_keys_prefix ON api_keys (prefix);

-- Creates the tenant schema and its tables. Called in the same transaction as
-- the organization's INSERT; the schema name is derived, never supplied.
CREATE FUNCTION create_tenant_schema(org uuid) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    schema_name text := 'tenant_' || replace(org::text, '-', '');
BEGIN
    EXECUTE format('CREATE SCHEMA %I', schema_name);
    EXECUTE format($f$CREATE TABLE %I.projects (
        id         uuid PRIMARY KEY,
        name       text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
        created_at timestamptz NOT NULL DEFAULT now()
    )$f$, schema_name);
    RETURN schema_name;
END $$;
