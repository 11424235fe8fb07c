-- A heartbeat's "kinds": [] was folded onto its node as an empty list by the release that brought kinds
-- (0030), where it said the agent takes none; since 0031's release it says every kind, which today's fold
-- writes as NULL, but the rows folded before stayed empty: `umbra verify` named each such node that never
-- beat again, and explain passed its agent over for every kind. The stored views are brought in line with
-- the fold: nothing today's fold writes is an empty list.
UPDATE nodes SET kinds = NULL WHERE kinds = '{}';
