"""A Python standard-library upstream for the `idem proxy` tests: it counts its side effects.

Prints `listening on PORT` once it accepts connections (port 0 picks a free one: pass it as
the first argument). It speaks HTTP/1.1; with `HTTP/1.0` as the second argument it answers
as HTTP/1.0 and closes each connection, as Python's `http.server` does by default.

- `POST|PATCH /charge...`: one side effect, counted per `Idempotency-Key` with the
  `Idempotency-Attempt` it came with, at once (before any delay); waits `X-Delay-Ms`, then
  answers 201 with a JSON document holding a fresh number (so two executions never answer
  alike).
- `POST /status/NNN`: a counted side effect answered with status NNN.
- `POST /hang`: a counted side effect that never answers (the proxy's timeout fires).
- `GET /count?key=K`: how many times key K ran, and with which attempts, as JSON.
- `* /echo...`: the request as JSON (method, target, headers, body in latin-1), for
  pass-through checks.
- `GET /stream`: a chunked response in five parts, 100 ms apart.
- `GET|POST /events?n=N&ms=D`: a counted side effect answered with Server-Sent Events, N
  (default 5) events D ms (default 200) apart, chunked; `GET /events/status?key=K` says how
  many events the run of key K sent, and whether it ended or its connection was cut.
"""

import json
import sys
import time
from urllib.parse import parse_qs, urlsplit

from counting import LOCK, CountingHandler, serve

STREAMS = {}  # key -> {"sent": n, "ended": bool, "cut": bool}, of its last run


class Handler(CountingHandler):
    def side_effect(self):
        """Counts one run of this request's key; returns the runs of every key so far."""
        return self.count_run()[1]

    def do_GET(self):
        url = urlsplit(self.path)
        if self.answer_counts(url):
            return None
        if url.path == "/events/status":
            key = parse_qs(url.query).get("key", [""])[0]
            with LOCK:
                status = dict(STREAMS.get(key, {}))
            return self.reply(200, status)
        if url.path == "/events":
            return self.events(url)
        if url.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(5):
                chunk = f"part {i}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"0\r\n\r\n")
            return None
        return self.other()

    def do_POST(self):
        url = urlsplit(self.path)
        body = self.body()
        if url.path == "/events":
            return self.events(url)
        if url.path.startswith("/echo"):
            return self.echo(body)
        serial = self.side_effect()
        if url.path.startswith("/status/"):
            return self.reply(int(url.path.rsplit("/", 1)[1]), {"serial": serial})
        if url.path == "/hang":
            time.sleep(3600)
            return None
        delay = int(self.headers.get("X-Delay-Ms") or 0)
        time.sleep(delay / 1000)
        return self.reply(
            201,
            {"charge": serial, "attempt": self.headers.get("Idempotency-Attempt"),
             "body": body.decode("latin-1")},
            [("Location", f"/charges/{serial}"), ("X-Charge-Serial", str(serial))],
        )

    do_PATCH = do_POST

    def events(self, url):
        """Server-Sent Events, one chunk each, written as they are made."""
        query = parse_qs(url.query)
        count = int(query.get("n", ["5"])[0])
        gap = int(query.get("ms", ["200"])[0]) / 1000
        key = self.headers.get("Idempotency-Key", "")
        serial = self.side_effect()
        status = {"sent": 0, "ended": False, "cut": False}
        with LOCK:
            STREAMS[key] = status
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i in range(count):
                if i:
                    time.sleep(gap)
                chunk = f"id: {i}\ndata: run {serial} event {i}\n\n".encode()
                # Counted before it is written, so that a client holding an event never
                # finds it uncounted.
                with LOCK:
                    status["sent"] = i + 1
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            with LOCK:
                status["ended"] = True
        except OSError:
            # The proxy closed the connection: its client left and the route cancels.
            with LOCK:
                status["cut"] = True
            self.close_connection = True

    def other(self):
        url = urlsplit(self.path)
        if url.path.startswith("/echo"):
            return self.echo(self.body())
        return self.reply(404, {"error": "no such route"})

    do_PUT = other
    do_DELETE = other

    def echo(self, body):
        headers = [[name.lower(), value] for name, value in self.headers.items()]
        self.reply(200, {
            "method": self.command,
            "target": self.path,
            "headers": headers,
            "body": body.decode("latin-1"),
        }, [("X-Upstream", "python")])


if __name__ == "__main__":
    if len(sys.argv) > 2:
        Handler.protocol_version = sys.argv[2]
    serve(Handler)
