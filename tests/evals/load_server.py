"""A stand-in OpenAI-compatible completions server with a set capacity, on 127.0.0.1, for load sweeps.

No GPU engine runs here, and `transformers serve` on this CPU neither sustains a rate worth
measuring nor holds one steady. This server stands in for the engine's prefill: one worker takes
the requests first come, first served, and spends ``prefill_s`` (x a uniform jitter in
[1 - jitter, 1 + jitter]) on each before its first token, so it sustains 1 / prefill_s requests per
second and queues beyond that, the way TTFT grows when a real server saturates. Output tokens are
then streamed concurrently (``itl_s`` apart), as a batching engine decodes. It speaks what guidellm
0.8.1 sends and reads for ``/v1/completions`` with ``stream: true``
(guidellm/backends/openai/request_handlers.py, ``TextCompletionsRequestHandler.add_streaming_line``:
SSE ``data:`` lines with ``choices[0].text`` and a final ``usage``, then ``data: [DONE]``), plus
``GET /v1/models`` and ``/health``.

Run: ``python -m tests.evals.load_server --port P --prefill-s 0.2`` (prints ``ready PORT``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.evals.conftest import send_json

_ids = itertools.count()


class Engine:
    """The single prefill worker: requests wait their turn in a FIFO queue."""

    def __init__(self, prefill_s: float, jitter: float, seed: int):
        self.prefill_s, self.jitter, self.rng = prefill_s, jitter, random.Random(seed)
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while True:
            done = self.jobs.get()
            time.sleep(self.prefill_s * (1 + self.jitter * (2 * self.rng.random() - 1)))
            done.set()

    def prefill(self) -> None:
        done = threading.Event()
        self.jobs.put(done)
        done.wait()


def make_handler(engine: Engine, model: str, tokens: int, itl_s: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the stream ends when the connection closes

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            if self.path.rstrip("/").endswith("/models"):
                return send_json(self, {"object": "list", "data": [{"id": model, "object": "model"}]})
            if self.path.startswith("/health"):
                return send_json(self, {"status": "ok"})
            return send_json(self, {"error": {"message": f"no route {self.path}"}}, 404)

        def do_POST(self):
            try:
                self._answer()
            except (BrokenPipeError, ConnectionResetError):  # guidellm cancels requests still running at its limit
                self.close_connection = True

        def _answer(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if not self.path.endswith("/v1/completions"):
                return send_json(self, {"error": {"message": f"no route {self.path}"}}, 404)
            if body.get("model") != model:
                return send_json(self, {"error": {"message": f"model {body.get('model')!r} is not served"}},
                                 404)
            n = min(int(body.get("max_tokens") or tokens), tokens)
            rid = f"cmpl-{next(_ids)}"
            engine.prefill()
            if not body.get("stream"):
                return send_json(self, {"id": rid, "object": "text_completion", "model": model,
                                        "choices": [{"index": 0, "text": " tok" * n, "finish_reason": "length"}],
                                        "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
            self._stream(rid, n, body)
            return None

        def _stream(self, rid: str, n: int, body: dict) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(n):
                if i:
                    time.sleep(itl_s)
                chunk = {"id": rid, "object": "text_completion", "model": model,
                         "choices": [{"index": 0, "text": " tok", "finish_reason": "length" if i == n - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"id": rid, "object": "text_completion", "model": model, "choices": [],
                     "usage": {"prompt_tokens": len(str(body.get("prompt", "")).split()), "completion_tokens": n,
                               "total_tokens": n}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()

    return Handler


def serve(prefill_s: float, model: str = "standin", port: int = 0, tokens: int = 8, itl_s: float = 0.005,
          jitter: float = 0.5, seed: int = 0) -> ThreadingHTTPServer:
    """Start in daemon threads; ``server_address[1]`` is the port, ``shutdown()`` stops it."""
    server = ThreadingHTTPServer(("127.0.0.1", port),
                                 make_handler(Engine(prefill_s, jitter, seed), model, tokens, itl_s))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="standin")
    parser.add_argument("--prefill-s", type=float, default=0.2, help="seconds of prefill per request (capacity 1/x)")
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per request (at most)")
    parser.add_argument("--itl-s", type=float, default=0.005)
    parser.add_argument("--jitter", type=float, default=0.5)
    args = parser.parse_args()
    srv = serve(args.prefill_s, args.model, args.port, args.tokens, args.itl_s, args.jitter)
    print("ready", srv.server_address[1], flush=True)
    threading.Event().wait()
