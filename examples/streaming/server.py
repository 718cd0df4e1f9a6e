"""An LLM-like streaming service, standard library only: `POST /complete` answers with
Server-Sent Events, one token every 50 ms, each event with its `id`, and counts its runs
(each run is a completion the service would bill). `GET /runs` says how many ran.

    python3 server.py [ADDR]        (ADDR: PORT or HOST:PORT, default 127.0.0.1:3002)

It knows nothing of idempotency: `idem proxy` in front of it makes a retried or duplicated
completion stream once, joined by duplicates and resumed with `Last-Event-ID`.
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS = ("Idempotency keys make a retried request run once , " * 3).split()
LOCK = threading.Lock()
RUNS = [0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        with LOCK:
            body = json.dumps({"runs": RUNS[0]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        with LOCK:
            RUNS[0] += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i, token in enumerate(TOKENS):
                event = f"id: {i}\ndata: {token}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass


def main():
    addr = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:3002"
    host, _, port = addr.rpartition(":")
    server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
    server.daemon_threads = True
    print(f"streaming on http://{host or '127.0.0.1'}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
