-- Pairing codes are found by their hash. Until now each code was hashed with a
-- salt of its own, so a redemption had to verify the candidate against every
-- live code in turn: one argon2id computation (about 60 ms) per live code, in
-- every organization, for each unauthenticated attempt, and as many again for
-- each new code of a name already waiting. Every code is now hashed with one
-- salt drawn for this database (the same argon2id profile), so a redemption
-- hashes the candidate once and looks it up.
--
-- The salt is random per database: a table of the million codes' hashes made
-- for another installation is useless here. Nothing but this migration writes
-- it.
CREATE TABLE pairing_salt (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    salt     bytea NOT NULL CHECK (octet_length(salt) = 16)
);
INSERT INTO pairing_salt (salt) VALUES (uuid_send(gen_random_uuid()));
REVOKE INSERT, UPDATE, DELETE ON pairing_salt FROM umbra_service;

CREATE INDEX pairing_codes_by_hash ON pairing_codes (code_hash) WHERE redeemed_at IS NULL;

-- Codes issued before this migration carry salts of their own and cannot be
-- found by their hash: they end now. A code lives half an hour at most, and
-- the invalid-code answer asks for a new one.
UPDATE pairing_codes SET expires_at = now() WHERE redeemed_at IS NULL AND expires_at > now();
