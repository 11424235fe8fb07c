-- A job split into children (job.decomposed) becomes a container, released
-- by the node that split it: it runs nowhere while its children run. Its row
-- kept the claim's placement, so the queue view and the dashboard showed it
-- running on that node's device, and explain said a cancelled container was
-- "cancelled while running" there. The fold now clears the placement at the
-- decomposition (the claim event still records where the split ran); the
-- rows of containers already split are brought in line with it.
UPDATE jobs SET placement = NULL WHERE children_total > 0 AND placement IS NOT NULL;
