"""An agent's own HTTP server receiving its webhooks (REACH §12): each request is
checked to come from the relay, signed with the agent's own secret, before
anything is done with it. The standard library only, besides relay.

    DSH_RELAY_SECRET_FILE=conf/relay.secret python docs/examples/webhook_receiver.py 8080

then register the agent with {"webhook": {"url": "http://127.0.0.1:8080/relay"}}.
"""

import os
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from relay.client.webhook_receiver import WebhookRejected, verify

with open(os.environ["DSH_RELAY_SECRET_FILE"]) as file:
    SECRET = file.read().strip()
handled = set()  # event ids: a webhook comes at least once, maybe twice


class Webhook(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            event = verify(SECRET, "POST", self.path, dict(self.headers), body, time.time())
        except WebhookRejected as rejected:
            self.send_error(401, rejected.reason)
            return
        self.send_response(204)  # a 2xx within 10 s acknowledges the event
        self.end_headers()
        if event.id in handled:
            return
        handled.add(event.id)
        if event.type == "message":  # pull it now (here: just say so)
            print(f"a {event.data['kind']} from {event.data['from']!r} to pull", flush=True)
        elif event.type == "status":
            print(f"my message is {event.data['status']}", flush=True)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Webhook).serve_forever()
