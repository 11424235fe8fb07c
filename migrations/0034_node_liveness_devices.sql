-- A heartbeat whose free memory moved less than its tolerance (2 % of the
-- device's total, at least 128 MB) records no event, so the node's folded
-- devices keep the figures of its last recorded beat: claims, explain and the
-- node views judged memory up to that far off, for up to the interval between
-- recorded beats. The devices as the node last reported them are now kept
-- beside when it was last heard from, at every beat, as a measurement outside
-- the fold like last_seen_at; readers take them over the folded ones. NULL: no
-- beat has reported devices since this column came (the folded ones stand).
ALTER TABLE node_liveness ADD COLUMN devices jsonb;
COMMENT ON COLUMN node_liveness.devices IS 'the devices as the last beat reported them (normalized), every beat';
