-- How far a running job is, as its holder last said with a renewal (`job.lease_renewed`'s `progress`):
-- `{"fraction"?, "message"?}`, NULL until it says, and again from each new claim (a new run starts over).
ALTER TABLE jobs ADD COLUMN progress jsonb;
