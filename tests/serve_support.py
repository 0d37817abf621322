"""What the serve tests share (tests/scoring/test_serve.py, test_serve_engine.py): the question they
ask, a long request, a client that leaves on a raw socket, the wait for a freed slot, and the chunks
of a stream gathered per choice."""

from __future__ import annotations

import json
import socket
import time

QUESTION = "Where was Tavo Mir born?"

# a request whose answer runs long (no stop the tiny model writes, sampled): 90 tokens of a slowed model
LONG = {"model": "tiny", "prompt": QUESTION, "max_tokens": 90, "seed": 1, "stop": ["nothing like this"],
        "temperature": 1.0}  # fmt: skip


def send_raw(srv, body: dict):
    """A socket that has sent `body` as a POST to /v1/completions of the server `srv`."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(srv.http.server_address, timeout=60)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def leave_after_first_chunk(srv, body: dict) -> bytes:
    """A streamed request whose client reads up to its first chunk and closes the connection: what it read."""
    sock, seen = send_raw(srv, body), b""
    while b"data: " not in seen:
        got = sock.recv(4096)
        assert got, f"the stream ended before its first chunk: {seen!r}"
        seen += got
    sock.close()  # the client goes
    return seen


def until_not_429(ask, wait_s: float = 60.0) -> tuple[int, dict]:
    """`ask()` ((status, body)) again every 50 ms while it is refused with a 429, at most `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        code, out = ask()
        if code != 429 or time.monotonic() > deadline:
            return code, out
        time.sleep(0.05)


def streamed(chunks) -> dict[int, dict]:
    """Per choice: the texts and token ids of its chunks, their running scores, and its last chunk."""
    out: dict[int, dict] = {}
    for ch in chunks:
        assert len(ch.choices) == 1
        c = ch.choices[0]
        got = out.setdefault(c.index, {"text": "", "ids": [], "running": [], "last": None})
        delta = c.delta.content if hasattr(c, "delta") else c.text
        got["text"] += delta or ""
        got["ids"] += c.token_ids
        if c.finish_reason is None:
            got["running"].append(c.hallucination["running_score"])
        else:
            assert got["last"] is None, "one last chunk per choice"
            got["last"] = c
    return out
