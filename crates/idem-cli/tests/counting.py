"""What the Python test services (`handler.py` for `idem consume`, `upstream.py` for `idem
proxy`) share: a JSON reply, the count of runs per `Idempotency-Key` with the
`Idempotency-Attempt` each came with and the headers of the last, `GET /count?key=K` and
`GET /counts` answered from it, and the server started on the port of the first argument.
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

LOCK = threading.Lock()
RUNS = {}  # key -> [attempt, ...]
LAST = {}  # key -> {header: value} of its last run


class CountingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def reply(self, status, doc, headers=()):
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def count_run(self):
        """Counts one run of this request's key; returns whether it is the key's first, and
        the number of runs of every key so far (this one included)."""
        key = self.headers.get("Idempotency-Key", "")
        attempt = self.headers.get("Idempotency-Attempt", "")
        with LOCK:
            first = key not in RUNS
            RUNS.setdefault(key, []).append(attempt)
            last = {name.lower(): value for name, value in self.headers.items()}
            last[":path"] = self.path
            LAST[key] = last
            return first, sum(len(runs) for runs in RUNS.values())

    def answer_counts(self, url):
        """Answers `GET /count?key=K` and `GET /counts`; `False` for any other path."""
        if url.path == "/counts":
            with LOCK:
                counts = {key: len(runs) for key, runs in RUNS.items()}
            self.reply(200, counts)
            return True
        if url.path != "/count":
            return False
        key = parse_qs(url.query).get("key", [""])[0]
        with LOCK:
            attempts = list(RUNS.get(key, []))
            last = dict(LAST.get(key, {}))
        self.reply(200, {"runs": len(attempts), "attempts": attempts, "last": last})
        return True


def serve(handler):
    """Serves `handler` on 127.0.0.1 at the port of the first argument (0, or none: a free
    one), and prints `listening on PORT` once it accepts connections."""
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()
