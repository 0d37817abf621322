"""A scripted OpenAI-compatible chat server on 127.0.0.1: for tests, benchmarks and offline demos.

`FakeOpenAI(responder)` serves `POST /v1/chat/completions` (and `GET /v1/models`) over real
HTTP, so the real `openai` client, its retries and our cache are what is exercised.
`responder(body, n)` gets the request body and the request's 0-based number (its headers are
in `srv.headers[n]`), and returns the reply text, or a `Fault` (any status, headers, raw body,
delay, a body trickled byte by byte) to inject errors: 429 with Retry-After, 500, slow or
trickling replies, malformed bodies, unparseable text, error bodies that echo the key.

`rule_responder(knowledge)` answers the paper's prompts the way the offline backends do
(`match` judge, `exact` NLI), so a pipeline run through the `openai` backends against this
server must give the offline labels. Run one in the foreground with
`python -m halludetect.testing.fake_openai --port 8000 --latency 0.05 --knowledge data/questions/world.parquet`.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from halludetect.labels.text import contains, normalise, recall


@dataclass
class Fault:
    status: int = 500
    headers: dict[str, str] = field(default_factory=dict)
    body: str | None = None  # raw body; None = an OpenAI-style error object
    delay: float = 0.0  # seconds before answering (beyond the server's latency)
    trickle: float = 0.0  # > 0: send the body one byte every `trickle` seconds (a stalling server)
    cut: int | None = None  # send only this many bytes of the body, then close the connection (a cut body)


Responder = Callable[[dict, int], "str | None | Fault"]


def completion(text: str | None, body: dict, n: int) -> dict:
    prompt = " ".join(m.get("content") or "" for m in body.get("messages", []))
    completion_tokens = len((text or "").split())
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", "fake"),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        "usage": {
            "prompt_tokens": len(prompt.split()),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt.split()) + completion_tokens,
        },
    }


def send(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: str,
    headers: dict | None = None,
    trickle: float = 0.0,
    cut: int | None = None,
) -> None:
    """Write a JSON response: at once, a byte every `trickle` seconds, or cut off after `cut`
    bytes of the body (the full length announced, then the connection closed)."""
    data = body.encode()
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    head_bytes = ("\r\n".join(head) + "\r\n\r\n").encode()
    try:
        if cut is not None:
            handler.wfile.write(head_bytes + data[:cut])
            handler.wfile.flush()
            handler.close_connection = True
            return
        if not trickle:  # status line, headers and body in one write, as servers do
            handler.wfile.write(head_bytes + data)
            return
        handler.wfile.write(head_bytes)
        for i in range(len(data)):  # every read gets a byte in time: only a deadline ends it
            handler.wfile.write(data[i : i + 1])
            handler.wfile.flush()
            time.sleep(trickle)
    except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
        handler.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default backlog (5) resets connections when many clients connect at once


class FakeOpenAI:
    """Context manager: `with FakeOpenAI(responder, latency=0.05) as srv: ... srv.url ...`."""

    def __init__(self, responder: Responder, latency: float = 0.0, port: int = 0, models: tuple[str, ...] = ()):
        self.responder, self.latency, self.models = responder, latency, models
        self.requests: list[dict] = []
        self.headers: list[dict[str, str]] = []  # per request, names lower-cased
        self._lock = threading.Lock()
        self.server = _Server(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def count(self) -> int:
        return len(self.requests)

    def _handler(self):
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real endpoints

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                # As real servers do: without it, Nagle's algorithm against the client's delayed
                # ACKs adds ~40 ms to replies written in two pieces.
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _send(
                self, status: int, body: str, headers: dict | None = None, trickle: float = 0.0, cut: int | None = None
            ) -> None:
                send(self, status, body, headers, trickle, cut)

            def do_GET(self):
                if self.path.rstrip("/").endswith("/stats"):  # for benchmarks in another process
                    with srv._lock:
                        bodies = {json.dumps(b, sort_keys=True) for b in srv.requests}
                        self._send(200, json.dumps({"requests": len(srv.requests), "distinct": len(bodies)}))
                elif self.path.rstrip("/").endswith("/models"):
                    self._send(
                        200,
                        json.dumps(
                            {
                                "object": "list",
                                "data": [
                                    {"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in srv.models
                                ],
                            }
                        ),
                    )
                else:
                    self._send(404, json.dumps({"error": {"message": "not found", "type": "invalid_request_error"}}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with srv._lock:
                    n = len(srv.requests)
                    srv.requests.append(body)
                    srv.headers.append({k.lower(): v for k, v in self.headers.items()})
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    return self._send(404, json.dumps({"error": {"message": f"no route {self.path}"}}))
                if srv.models and body.get("model") not in srv.models:
                    return self._send(
                        404,
                        json.dumps(
                            {
                                "error": {
                                    "message": f"The model `{body.get('model')}` does not exist",
                                    "type": "invalid_request_error",
                                    "code": "model_not_found",
                                }
                            }
                        ),
                    )
                out = srv.responder(body, n)
                if isinstance(out, Fault):
                    time.sleep(srv.latency + out.delay)
                    err = json.dumps({"error": {"message": f"injected {out.status}", "type": "server_error"}})
                    if out.status == 200 and out.body is None:  # a good reply, delivered slowly
                        err = json.dumps(completion("yes", body, n))
                    return self._send(
                        out.status, out.body if out.body is not None else err, out.headers, out.trickle, out.cut
                    )
                time.sleep(srv.latency)
                self._send(200, json.dumps(completion(out, body, n)))

        return Handler


# ------------------------------------------------------------------------ rule responder
_JUDGE_Q = re.compile(r"following question: (.*)\n")
_JUDGE_REFS = re.compile(r"(?:The expected answer is|The following are expected answers to this question): (.*)\.\n")
_JUDGE_A = re.compile(r"The proposed answer is: (.*)\n")
_NLI = re.compile(r"Answer A: (.*)\nAnswer B: (.*)\n")


def rule_responder(knowledge: dict[str, list[str]] | None = None, lenient_recall: float = 0.5) -> Responder:
    """Answers prompt 2 (with or without references) like the `match` judge and prompt 3 like
    the `exact` NLI backend. `knowledge` (question -> reference answers) stands in for the
    judge's "own knowledge" in the pass without references; a question it lacks gets "no"."""
    knowledge = {q.strip(): refs for q, refs in (knowledge or {}).items()}

    def respond(body: dict, n: int) -> str:
        prompt = body["messages"][-1]["content"]
        if m := _NLI.search(prompt):
            return "entailment" if normalise(m[1]) == normalise(m[2]) else "neutral"
        question, answer = _JUDGE_Q.search(prompt)[1].strip(), _JUDGE_A.search(prompt)[1]
        if refs := _JUDGE_REFS.search(prompt):
            return "Yes." if any(contains(answer, r) for r in refs[1].split("; ")) else "No."
        refs = knowledge.get(question, [])
        return "yes" if any(recall(answer, r) >= lenient_recall for r in refs) else "no"

    return respond


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--latency", type=float, default=0.0, help="seconds added to every reply")
    p.add_argument("--knowledge", help="questions Parquet (question, answers) for the pass without references")
    a = p.parse_args()
    knowledge = None
    if a.knowledge:
        import polars as pl

        df = pl.read_parquet(a.knowledge)
        knowledge = dict(zip(df["question"], df["answers"].to_list()))
    with FakeOpenAI(rule_responder(knowledge), latency=a.latency, port=a.port) as srv:
        print(f"serving {srv.url} (Ctrl-C to stop)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
