"""A Python standard-library message handler for the `idem consume` tests: it counts its runs.

Prints `listening on PORT` once it accepts connections (port 0 picks a free one: pass it as
the first argument).

- `POST /...`: one run, counted per `Idempotency-Key` with the `Idempotency-Attempt` it came
  with, at once (before any delay), with the request's headers. The JSON body says how to
  answer: `delay_ms` to wait first (default 0), `delay_first_ms` to wait on the key's first
  run only, `status` to answer with (default 200), `retry_after` for a `Retry-After` header.
- `GET /count?key=K`: how many times key K ran, with which attempts, and the headers of its
  last run, as JSON.
- `GET /counts`: how many times each key ran, as a JSON object.
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

LOCK = threading.Lock()
RUNS = {}  # key -> [attempt, ...]
LAST = {}  # key -> {header: value} of its last run


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

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
        url = urlsplit(self.path)
        if url.path == "/counts":
            with LOCK:
                counts = {key: len(runs) for key, runs in RUNS.items()}
            return self.reply(200, counts)
        if url.path != "/count":
            return self.reply(404, {"error": "no such route"})
        key = parse_qs(url.query).get("key", [""])[0]
        with LOCK:
            attempts = list(RUNS.get(key, []))
            last = dict(LAST.get(key, {}))
        return self.reply(200, {"runs": len(attempts), "attempts": attempts, "last": last})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        key = self.headers.get("Idempotency-Key", "")
        attempt = self.headers.get("Idempotency-Attempt", "")
        with LOCK:
            first = key not in RUNS
            RUNS.setdefault(key, []).append(attempt)
            last = {name.lower(): value for name, value in self.headers.items()}
            last[":path"] = self.path
            LAST[key] = last
            serial = sum(len(runs) for runs in RUNS.values())
        try:
            order = json.loads(body or b"{}")
        except ValueError:
            order = {}
        if not isinstance(order, dict):
            order = {}
        time.sleep(int(order.get("delay_ms", 0)) / 1000)
        if first:
            time.sleep(int(order.get("delay_first_ms", 0)) / 1000)
        headers = []
        if "retry_after" in order:
            headers.append(("Retry-After", str(order["retry_after"])))
        status = int(order.get("status", 200))
        return self.reply(status, {"run": serial, "attempt": attempt}, headers)


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
