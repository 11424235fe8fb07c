-- The job kinds a node's agent takes (the kinds it names in its claims), as its
-- heartbeat reports them; NULL until it does (an agent that names none takes every
-- kind). explain uses it to say that a job waits for an agent with a handler for
-- its kind rather than for a device. Older node.heartbeat events carry no kinds,
-- so every row stays NULL, as a rebuild from the log would have it.
ALTER TABLE nodes ADD COLUMN kinds text[];
