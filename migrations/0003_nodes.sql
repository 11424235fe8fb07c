-- Nodes, their credentials, pairing codes and the model registry.
-- `nodes` is a projection: a pure fold of each node's event stream
-- (umbra.projections.nodes), rebuilt and compared by `umbra verify`.
-- `node_liveness` is deliberately *not* folded: it is the last moment a node was
-- heard from, a measurement refreshed on every heartbeat, while the log records
-- only transitions (and an unchanged heartbeat at most every few minutes).
CREATE TABLE nodes (
    id                uuid PRIMARY KEY,
    organization_id   uuid NOT NULL REFERENCES organizations (id),
    name              text NOT NULL,
    status            text NOT NULL CHECK (status IN ('provisioning', 'online', 'offline', 'draining', 'retired')),
    trust_domain      text NOT NULL DEFAULT 'local',
    locality          text,
    transport         text,
    agent_version     text,
    agent_started_at  timestamptz,
    last_heartbeat_at timestamptz,
    devices           jsonb NOT NULL DEFAULT '[]'::jsonb,
    version           integer NOT NULL,
    position          bigint NOT NULL,
    created_at        timestamptz NOT NULL,
    updated_at        timestamptz NOT NULL,
    CONSTRAINT nodes_name_per_org UNIQUE (organization_id, name)
);

CREATE TABLE node_liveness (
    node_id      uuid PRIMARY KEY REFERENCES nodes (id),
    last_seen_at timestamptz NOT NULL
);

CREATE TABLE node_credentials (
    id              uuid PRIMARY KEY,
    node_id         uuid NOT NULL REFERENCES nodes (id),
    organization_id uuid NOT NULL REFERENCES organizations (id),
    prefix          text NOT NULL,
    secret_hash     text NOT NULL,
    scopes          text[] NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    revoked_at      timestamptz
);
CREATE INDEX node_credentials_prefix ON node_credentials (prefix);

CREATE TABLE pairing_codes (
    id              uuid PRIMARY KEY,
    organization_id uuid NOT NULL REFERENCES organizations (id),
    node_name       text NOT NULL,
    code_hash       text NOT NULL,
    trust_domain    text NOT NULL DEFAULT 'local',
    locality        text,
    expires_at      timestamptz NOT NULL,
    redeemed_at     timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX pairing_codes_active ON pairing_codes (expires_at) WHERE redeemed_at IS NULL;

-- Fixed-window attempt counter for unauthenticated pairing redemption.
CREATE TABLE pairing_attempts (
    source       text NOT NULL,
    window_start timestamptz NOT NULL,
    attempts     integer NOT NULL,
    PRIMARY KEY (source, window_start)
);

CREATE TABLE models (
    organization_id       uuid NOT NULL REFERENCES organizations (id),
    slug                  text NOT NULL,
    kind                  text NOT NULL DEFAULT 'llm',
    vram_min_mb           integer NOT NULL DEFAULT 0 CHECK (vram_min_mb >= 0),
    vram_preferred_mb     integer CHECK (vram_preferred_mb >= 0),
    ram_min_mb            integer CHECK (ram_min_mb >= 0),
    requires_accelerators text[] NOT NULL DEFAULT '{}',
    reference_throughput  double precision,
    load_seconds          double precision,
    updated_at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (organization_id, slug)
);
