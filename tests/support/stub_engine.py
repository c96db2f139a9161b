"""A stand-in OpenAI-compatible engine for supervision tests (run as a script).

    python stub_engine.py PORT LOAD_S IGNORE_TERM(0|1) [HANG_AFTER_S]

Loads for LOAD_S seconds, forks a worker (as vLLM does) that would outlive it if only the
leader were signalled, then serves /health, /v1/models and vLLM-named /metrics. After
HANG_AFTER_S it stops answering anything (a hung engine).

Its model list changes at runtime as vLLM's does with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``POST /v1/load_lora_adapter`` {"lora_name",
"lora_path"} lists an adapter (``parent``: tiny-llama) and ``POST /v1/unload_lora_adapter``
{"lora_name"} removes it. ``POST /v1/chat/completions`` answers for any model listed (404
otherwise), naming the model. For tests of bad lists: ``POST /stub/models`` replaces the
``data`` of /v1/models with the body's, and ``POST /stub/models-broken`` {"broken": bool} makes
/v1/models answer 500.
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

BASE = {"id": "tiny-llama", "object": "model", "max_model_len": 512, "parent": None}
MODELS = {"object": "list", "data": [BASE]}
broken = False
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
            if broken:
                self.answer(500, {"error": "broken on purpose"})
                return
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

    def answer(self, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        global broken
        doc = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        listed = [m.get("id") for m in MODELS["data"] if isinstance(m, dict)]
        if self.path == "/v1/load_lora_adapter":
            name = doc["lora_name"]
            if name in listed:
                self.answer(400, {"error": f"The lora adapter '{name}' has already been loaded."})
                return
            adapter = {"id": name, "object": "model", "root": doc.get("lora_path")}
            adapter.update(parent=BASE["id"], max_model_len=None)
            MODELS["data"] = [*MODELS["data"], adapter]
            self.answer(200, f"Success: LoRA adapter '{name}' added successfully.")
        elif self.path == "/v1/unload_lora_adapter":
            name = doc["lora_name"]
            if name not in listed:
                self.answer(404, {"error": f"The lora adapter '{name}' cannot be found."})
                return
            MODELS["data"] = [
                m for m in MODELS["data"] if not isinstance(m, dict) or m.get("id") != name
            ]
            self.answer(200, f"Success: LoRA adapter '{name}' removed successfully.")
        elif self.path == "/v1/chat/completions":
            if doc.get("model") not in listed:
                self.answer(
                    404, {"error": {"message": f"The model `{doc.get('model')}` does not exist."}}
                )
                return
            choice = {"index": 0, "message": {"role": "assistant", "content": "stub"}}
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            answer = {"id": "chatcmpl-stub", "object": "chat.completion", "model": doc["model"]}
            self.answer(
                200, {**answer, "choices": [{**choice, "finish_reason": "stop"}], "usage": usage}
            )
        elif self.path == "/stub/models":
            MODELS["data"] = doc["data"]
            self.answer(200, {"ok": True})
        elif self.path == "/stub/models-broken":
            broken = bool(doc["broken"])
            self.answer(200, {"ok": True})
        else:
            self.answer(404, {"error": "not found"})

    def log_message(self, *args: object) -> None:
        pass


print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
