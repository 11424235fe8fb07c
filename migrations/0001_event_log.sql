-- The append-only log. Every job and node transition is a row here; every view
-- is a fold of these rows. Positions are allocated under one transaction-scoped
-- advisory lock held to commit (see umbra.events.store), so commit order equals
-- position order and a reader tailing "position > P" never skips a late commit.
CREATE TABLE events (
    position        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream          text        NOT NULL CHECK (stream ~ '^(job|node):[0-9a-f-]{36}$'),
    version         integer     NOT NULL CHECK (version >= 1),
    type            text        NOT NULL,
    organization_id uuid        NOT NULL,
    data            jsonb       NOT NULL,
    metadata        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT events_stream_version UNIQUE (stream, version)
);
CREATE INDEX events_organization_position ON events (organization_id, position);

-- Events are never updated or deleted, whoever asks. The service role is also
-- denied UPDATE/DELETE by grant (0006); this trigger covers the owner too.
CREATE FUNCTION events_are_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events are append-only (% refused)', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END $$;
CREATE TRIGGER events_no_update BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_are_immutable();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_are_immutable();
