-- 0006 took UPDATE, DELETE and TRUNCATE on schema_migrations from umbra_service but left INSERT: the
-- service could record a migration as applied that never ran, and every later `umbra migrate` would skip
-- it. Migrations are recorded by the role that runs them (the database's owner), never by the service.
REVOKE INSERT ON schema_migrations FROM umbra_service;
