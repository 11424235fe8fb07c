-- umbra: no transaction
-- Revoking a node (umbra.compute.credentials.revoke_node) finds its live credentials by node id: with no index of
-- node_id it read every credential ever issued, of every organization, revoked ones included (credentials are kept
-- for ever; at 300,000 of them, 100 ms of a sequential scan for the one live credential, holding its row lock on
-- the node meanwhile). A partial index of the live ones, as small as the fleet in service; the statement repeats
-- its predicate (revoked_at IS NULL), so a generic plan can use it. Built concurrently, so pairing and revocation go
-- on while it reads the table; dropped first if a build that stopped half-way left it invalid.
DROP INDEX CONCURRENTLY IF EXISTS node_credentials_live_by_node;
CREATE INDEX CONCURRENTLY node_credentials_live_by_node ON node_credentials (node_id) WHERE revoked_at IS NULL;
