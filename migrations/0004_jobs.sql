-- The queue projection: one row per job, a pure fold of the job's stream
-- (umbra.projections.jobs), written in the same transaction as the events so
-- the row a claim locks with SKIP LOCKED never disagrees with the log.
CREATE TABLE jobs (
    id               uuid PRIMARY KEY,
    organization_id  uuid NOT NULL REFERENCES organizations (id),
    kind             text NOT NULL,
    status           text NOT NULL CHECK (status IN ('queued', 'running', 'blocked', 'partial', 'complete', 'failed', 'cancelled')),
    requested_by     text,
    priority         integer NOT NULL,
    requires         jsonb NOT NULL DEFAULT '{}'::jsonb,
    payload          jsonb NOT NULL DEFAULT '{}'::jsonb,
    project_id       uuid,
    lang             text,
    attempt          integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL,
    not_before       timestamptz,
    parent_job_id    uuid REFERENCES jobs (id),
    idempotency_key  text,
    lease_owner      uuid,
    lease_expires_at timestamptz,
    result           jsonb,
    error            text,
    placement        jsonb,
    blocked_reason   text,
    blocked_at       timestamptz,
    children_total   integer NOT NULL DEFAULT 0,
    -- submission order: the log position of job.submitted (ties in priority)
    seq              bigint NOT NULL,
    version          integer NOT NULL,
    position         bigint NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    started_at       timestamptz,
    finished_at      timestamptz,
    CONSTRAINT jobs_idempotency_per_org UNIQUE (organization_id, idempotency_key)
);
CREATE INDEX jobs_claimable ON jobs (organization_id, priority, seq) WHERE status = 'queued';
CREATE INDEX jobs_leases ON jobs (lease_expires_at) WHERE status = 'running' AND lease_expires_at IS NOT NULL;
CREATE INDEX jobs_blocked ON jobs (organization_id, blocked_at) WHERE status = 'blocked';
CREATE INDEX jobs_parent ON jobs (parent_job_id) WHERE parent_job_id IS NOT NULL;
CREATE INDEX jobs_org_seq ON jobs (organization_id, seq);
