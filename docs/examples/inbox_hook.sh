#!/bin/sh
# A coding agent's hook (Claude Code: UserPromptSubmit) that tells the model at its
# next turn how many relay messages wait for it: those queued, not yet leased.
# Never a body, never a sender: a count. Settings come from DSH_RELAY_* or
# ~/.dsh-relay.json, as for every relay command.
count=$(relay query --status queued --limit 200 --json 2>/dev/null |
    python3 -c 'import json, sys; print(json.load(sys.stdin).get("count", 0))' 2>/dev/null)
case "$count" in
    '' | 0) exit 0 ;;
    1) echo "You have 1 relay message waiting: call relay_inbox to take it." ;;
    *) echo "You have $count relay messages waiting: call relay_inbox to take them." ;;
esac
