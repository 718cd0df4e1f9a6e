"""What the Python test services (`handler.py` for `idem consume`, `upstream.py` for `idem
proxy`) share: a JSON reply (the example handler's, `examples/consume/handler.py`), the
count of runs per `Idempotency-Key` with the `Idempotency-Attempt` each came with and the
headers of the last, `GET /count?key=K` and `GET /counts` answered from it, and the server
started on the port of the first argument.
"""

import importlib.util
import os
import sys
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs

# The README's example handler (examples/consume/handler.py) lends its JSON reply, so the
# test services answer as the documented handler does; its own routes are overridden.
_EXAMPLE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "consume",
    "handler.py",
)
_SPEC = importlib.util.spec_from_file_location("orders_handler", _EXAMPLE)
orders_handler = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(orders_handler)

LOCK = threading.Lock()
RUNS = {}  # key -> [attempt, ...]
LAST = {}  # key -> {header: value} of its last run


class CountingHandler(orders_handler.Handler):
    def log_message(self, *args):
        pass

    def body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

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
