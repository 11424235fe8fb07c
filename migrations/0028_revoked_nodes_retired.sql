-- A node whose credentials are revoked now reads 'retired' (umbra.domain.nodes.after_revoked):
-- nothing can give it a credential again, so it never takes work again, and read as 'offline' it
-- looked like a node that may come back (work only it could run stayed queued instead of blocked).
-- The stored view of every node revoked before this change is brought in line with the fold, so
-- `umbra verify` finds it equal to a rebuild; the sweeper's periodic pass then re-examines the
-- waiting jobs. Nothing can follow a revocation that would take a node out of 'retired'.
UPDATE nodes SET status = 'retired'
WHERE status <> 'retired'
  AND id IN (SELECT substr(stream, 6)::uuid FROM events WHERE type = 'node.revoked');
