-- Migration 7: authentication failures are counted per agent and source address
-- (docs/SECURITY.md, "Brute force and the lockout"). A row is an agent's count
-- and lock for one address (an IPv4 address, an IPv6 /64), or, with source '*',
-- the agent's own lock and the count of its failures from every address since
-- the start of the current lock period. The rows migration 1 made are the
-- agents' own.
ALTER TABLE relay_lockouts ADD COLUMN source text NOT NULL DEFAULT '*';
-- epoch seconds: for an address, its last failure; for '*', the period's start
ALTER TABLE relay_lockouts ADD COLUMN failed double precision;
ALTER TABLE relay_lockouts DROP CONSTRAINT relay_lockouts_pkey;
ALTER TABLE relay_lockouts ADD PRIMARY KEY (agent, source);
