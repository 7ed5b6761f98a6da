-- Migration 8: an inbox quota counts the whole stored message, not only its body:
-- the UTF-8 bytes of the body and of the envelope strings the sender chose (id,
-- sender, recipient, reply_to, root_id, parent_id). The usage rows are counted
-- again that way from the pending (queued or leased) messages.
DELETE FROM relay_inbox_usage;
INSERT INTO relay_inbox_usage (recipient, messages, bytes)
  SELECT recipient, count(*),
         coalesce(sum(octet_length(body) + octet_length(id) + octet_length(sender)
                      + octet_length(recipient) + coalesce(octet_length(reply_to), 0)
                      + coalesce(octet_length(root_id), 0)
                      + coalesce(octet_length(parent_id), 0)), 0)
  FROM relay_messages WHERE status IN ('queued', 'leased') GROUP BY recipient;
