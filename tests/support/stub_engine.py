"""A stand-in OpenAI-compatible engine for supervision tests (run as a script).

    python stub_engine.py PORT LOAD_S IGNORE_TERM(0|1) [HANG_AFTER_S]

Loads for LOAD_S seconds, forks a worker (as vLLM does) that would outlive it if only the
leader were signalled, then serves /health, /v1/models and vLLM-named /metrics. After
HANG_AFTER_S it stops answering anything (a hung engine).
"""

import http.server
import json
import os
import signal
import sys
import time

port, load_s, ignore_term = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
hang_after = float(sys.argv[4]) if len(sys.argv) > 4 else None
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = os.fork()
if worker == 0:
    while True:
        time.sleep(1)
print(f"engine {os.getpid()}", flush=True)
print(f"worker {worker}", flush=True)
print("loading weights", flush=True)
time.sleep(load_s)
ready_at = time.monotonic()

MODELS = {"object": "list", "data": [{"id": "tiny-llama", "object": "model", "max_model_len": 512}]}
METRICS = (
    'vllm:num_requests_waiting{model_name="tiny-llama"} 2.0\n'
    'vllm:num_requests_running{model_name="tiny-llama"} 5.0\n'
    'vllm:kv_cache_usage_perc{model_name="tiny-llama"} 0.25\n'
)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if hang_after is not None and time.monotonic() - ready_at > hang_after:
            time.sleep(3600)
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            body = json.dumps(MODELS).encode()
        elif self.path == "/metrics":
            body = METRICS.encode()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
