-- Claim requests their agents gave up on (POST /v1/agent/claim/release), by node and request id, kept
-- in the database so that every server process sees them: a claim request held up on its way reaches
-- whichever process a load balancer picks, perhaps not the one that answered the release. A claim reads
-- its request's row in its own transaction (after sharing its node's claim guard, which the release holds
-- exclusively) and claims nothing when it is there. Not an event: the releases it causes are
-- (job.released); the row only has to outlive a request's trip, and the sweeper prunes it after that.
CREATE TABLE abandoned_claim_requests (
    node_id      uuid NOT NULL REFERENCES nodes (id),
    request_id   text NOT NULL CHECK (length(request_id) BETWEEN 1 AND 128),
    abandoned_at timestamptz NOT NULL,
    PRIMARY KEY (node_id, request_id)
);
CREATE INDEX abandoned_claim_requests_by_age ON abandoned_claim_requests (abandoned_at);
