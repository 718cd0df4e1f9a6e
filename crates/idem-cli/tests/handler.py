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
import time
from urllib.parse import urlsplit

from counting import CountingHandler, serve


class Handler(CountingHandler):
    def do_GET(self):
        if not self.answer_counts(urlsplit(self.path)):
            self.reply(404, {"error": "no such route"})

    def do_POST(self):
        body = self.body()
        attempt = self.headers.get("Idempotency-Attempt", "")
        first, serial = self.count_run()
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


if __name__ == "__main__":
    serve(Handler)
