-- Migration 9: the events of REACH §11 and the webhooks of §12.
-- Events are recorded with the change that causes them and kept
-- broker.eventRetentionSeconds. An agent's events are inserted under a
-- transaction lock of that agent (class 0x72656C02), so its ids become visible
-- in order; a stream reads its agent's events after an id by relay_events_agent.
-- Retention removes the oldest by relay_events_at (BRIN: times grow with ids,
-- and the index costs an insert next to nothing); relay_event_marks keeps the
-- highest id removed ('floor').
CREATE TABLE relay_events
(
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  agent text NOT NULL,
  at double precision NOT NULL,
  type text NOT NULL,
  data text NOT NULL
);
CREATE INDEX relay_events_agent ON relay_events (agent, id);
CREATE INDEX relay_events_at ON relay_events USING brin (at);
CREATE TABLE relay_event_marks
(
  key text PRIMARY KEY,
  value bigint NOT NULL
);
-- Each agent's webhook and its progress (JSON); no row: no webhook. The row '*'
-- names the broker that delivers every webhook and until when (it is renewed);
-- it exists from the start so that brokers taking the role lock one row.
CREATE TABLE relay_webhooks
(
  agent text PRIMARY KEY,
  state text NOT NULL
);
INSERT INTO relay_webhooks (agent, state) VALUES ('*', '{}');
-- The queued messages held back by a delay, whose end records their message
-- event (not_before is cleared then); only those rows are in it.
CREATE INDEX relay_messages_held ON relay_messages (not_before)
  WHERE status = 'queued' AND not_before IS NOT NULL;
