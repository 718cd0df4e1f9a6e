"""An orders service's message handler, in Python with the standard library only: each
`POST /orders` "charges" the order in its body, and `GET /orders` lists the charges made.

It charges again on every call: it does nothing about duplicates. In front of it,
`idem consume` reads a queue and calls it once per idempotency key (README.md, "idem
consume: any service's message handler").

    python3 examples/consume/handler.py 3000

What it answers, as `idem consume` reads it: 201 (the charge is stored and the message
acked), 422 for a body that is not an order (dead-lettered at once, never retried), 503
with `Retry-After` while the order says `"fail": true` (retried later).
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
CHARGES = []  # every charge made, duplicates included


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, status, doc, headers=()):
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/orders":
            return self.reply(404, {"error": "no such route"})
        with LOCK:
            return self.reply(200, {"charges": len(CHARGES), "made": CHARGES})

    def do_POST(self):
        if self.path != "/orders":
            return self.reply(404, {"error": "no such route"})
        length = int(self.headers.get("Content-Length") or 0)
        try:
            order = json.loads(self.rfile.read(length) or b"null")
            amount = int(order["amount"])
        except (ValueError, KeyError, TypeError):
            return self.reply(422, {"error": "an order is {\"amount\": N}"})
        if order.get("fail"):
            return self.reply(503, {"error": "the bank is down"}, [("Retry-After", "2")])
        charge = {
            # idem consume sends the message's key and which attempt this is.
            "key": self.headers.get("Idempotency-Key"),
            "attempt": self.headers.get("Idempotency-Attempt"),
            "amount": amount,
        }
        with LOCK:
            CHARGES.append(charge)
            charge["id"] = len(CHARGES)
        return self.reply(201, charge)


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"orders handler: listening on http://127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
