"""The persistent cache of paid chat-API replies, shared by every run, workspace and queued experiment.

One SQLite file, `$HALLUDETECT_CACHE/api_calls.sqlite` (else `~/.cache/halludetect/`), outside
DVC's outputs (which DVC deletes before a stage runs) and outside any experiment's temporary
copy, so a re-run, a resumed run or a queued experiment never pays for a reply twice.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path


def cache_path() -> Path:
    """`$HALLUDETECT_CACHE/api_calls.sqlite`, else `~/.cache/halludetect/api_calls.sqlite`."""
    if root := os.environ.get("HALLUDETECT_CACHE"):
        return Path(root) / "api_calls.sqlite"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "halludetect" / "api_calls.sqlite"


class CallCache:
    """Replies by request key. One row per paid call, committed as it arrives (WAL mode, so a
    killed process keeps every committed reply and several processes can share the file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # durable across a process kill; one fsync per checkpoint
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS calls (key TEXT PRIMARY KEY, request TEXT NOT NULL, reply TEXT,"
            " prompt_tokens INTEGER, completion_tokens INTEGER, reasoning_tokens INTEGER,"
            " latency_s REAL, created REAL)"
        )

    def get(self, key: str) -> dict | None:
        row = self.db.execute(
            "SELECT reply, prompt_tokens, completion_tokens, reasoning_tokens, latency_s FROM calls WHERE key = ?",
            (key,),
        ).fetchone()
        if row is None:
            return None
        return dict(zip(("reply", "prompt_tokens", "completion_tokens", "reasoning_tokens", "latency_s"), row))

    def put(self, key: str, request: dict, reply: dict) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (key, json.dumps(request, sort_keys=True), reply["reply"], reply["prompt_tokens"],
             reply["completion_tokens"], reply["reasoning_tokens"], reply["latency_s"], time.time()),
        )

    def __len__(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM calls").fetchone()[0]

    def close(self) -> None:
        self.db.close()
