-- A node's devices an operator took out of service one by one (a GPU throwing ECC or Xid errors, a card
-- waiting for a driver), by label, each with the reason given: `node.device_cordoned` and
-- `node.device_uncordoned` fold into it. Claims, blocking and explain judge a cordoned device ineligible
-- (`device_cordoned`); the node's other devices go on taking work.
ALTER TABLE nodes ADD COLUMN cordoned jsonb NOT NULL DEFAULT '{}'::jsonb;
