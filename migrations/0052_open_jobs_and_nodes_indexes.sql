-- umbra: no transaction
-- Reads bounded by what is open, not by the history jobs and nodes keep for ever (terminal jobs, retired nodes):
-- partial indexes, as small as the open queue and the fleet in service. Built concurrently, so writers go on
-- while they read the tables; each dropped first if a build that stopped half-way left it invalid. The reads
-- repeat each predicate whole, or the planner cannot use it for a statement with parameters (a generic plan).
--
-- The open jobs (queued, running, blocked) in submission order, per organization: GET /v1/jobs?status= read them
-- through jobs_org_seq, which holds every job the organization ever had, filtering by status (0.4-1 s at 4 million
-- terminal jobs; every status-filtered list, once a pooled connection had switched to the generic plan).
DROP INDEX CONCURRENTLY IF EXISTS jobs_open_by_seq;
CREATE INDEX CONCURRENTLY jobs_open_by_seq ON jobs (organization_id, seq) WHERE status IN ('queued', 'running', 'blocked');
-- The nodes in service (not draining, not retired), per organization in name order: the nodes a blocking
-- judgement counts (every submission reads them, umbra.compute.blocked), and those among which the sweeper looks
-- every tick for online ones gone silent (umbra.compute.nodes: online implies the predicate). Both read every node
-- ever paired, retired ones included.
DROP INDEX CONCURRENTLY IF EXISTS nodes_accepting;
CREATE INDEX CONCURRENTLY nodes_accepting ON nodes (organization_id, name) WHERE status NOT IN ('draining', 'retired');
