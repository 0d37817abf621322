"""The persistent cache of paid chat-API replies, shared by every run, workspace and queued experiment.

One SQLite file, `$HALLUDETECT_CACHE/api_calls.sqlite` (else `~/.cache/halludetect/`), outside
DVC's outputs (which DVC deletes before a stage runs) and outside any experiment's temporary
copy, so a re-run, a resumed run or a queued experiment never pays for a reply twice.

Several processes at once (`dvc queue start -j 2`, two terminals) share it safely: before
sending a request a process *claims* its key (table `claims`: owner, pid, host, lease). A
process that finds a live claim by another waits for that reply to land in `calls` instead
of sending the request itself. A claim is dead, and taken over, when its lease has expired
(the owner renews its leases while it runs) or when its owner is a process on this host that
no longer exists (a SIGKILLed run: taken over at once, not after the lease). A stored reply
removes its claim in the same transaction; a failed request releases it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from halludetect.core.processes import HOST, pid_alive

LEASE_S = 60.0  # a claim not renewed for this long is taken over (owners renew every LEASE_S / 3)


def cache_path() -> Path:
    """`$HALLUDETECT_CACHE/api_calls.sqlite`, else `~/.cache/halludetect/api_calls.sqlite`."""
    if root := os.environ.get("HALLUDETECT_CACHE"):
        return Path(root) / "api_calls.sqlite"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "halludetect" / "api_calls.sqlite"


@dataclass(frozen=True)
class Claim:
    owner: str
    host: str
    pid: int
    lease_until: float

    def alive(self, now: float) -> bool:
        """Still being asked: the lease holds and, on this host, the owning process exists."""
        return self.lease_until > now and (self.host != HOST or pid_alive(self.pid))


class CallCache:
    """Replies by request key. One row per paid call, committed as it arrives (WAL mode, so a
    killed process keeps every committed reply and several processes can share the file)."""

    def __init__(self, path: str | Path, lease_s: float = LEASE_S):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lease_s = lease_s
        # One owner per cache object: two runners in one process (threads) do not share claims.
        self.owner = f"{HOST}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # durable across a process kill; one fsync per checkpoint
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS calls (key TEXT PRIMARY KEY, request TEXT NOT NULL, reply TEXT,"
            " prompt_tokens INTEGER, completion_tokens INTEGER, reasoning_tokens INTEGER,"
            " latency_s REAL, created REAL)"
        )
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS claims (key TEXT PRIMARY KEY, owner TEXT NOT NULL, host TEXT NOT NULL,"
            " pid INTEGER NOT NULL, lease_until REAL NOT NULL)"
        )

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """A write transaction taken at once (BEGIN IMMEDIATE), committed or rolled back."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def get(self, key: str) -> dict | None:
        row = self.db.execute(
            "SELECT reply, prompt_tokens, completion_tokens, reasoning_tokens, latency_s FROM calls WHERE key = ?",
            (key,),
        ).fetchone()
        if row is None:
            return None
        return dict(zip(("reply", "prompt_tokens", "completion_tokens", "reasoning_tokens", "latency_s"), row))

    def claim_of(self, key: str) -> Claim | None:
        row = self.db.execute("SELECT owner, host, pid, lease_until FROM claims WHERE key = ?", (key,)).fetchone()
        return Claim(*row) if row else None

    def claim(self, key: str) -> tuple[Literal["reply", "mine", "wait"], dict | Claim | None]:
        """Before sending the request `key`: ("reply", reply) if one is stored; ("mine", None) if
        this cache's owner now holds the claim and should send it; ("wait", claim) if another
        live owner is sending it (poll `get`, then claim again)."""
        if (hit := self.get(key)) is not None:
            return "reply", hit
        other = self.claim_of(key)
        if other is not None and other.owner != self.owner and other.alive(time.time()):
            return "wait", other  # the common case of waiting costs no write lock
        with self._write():  # one writer at a time: two processes cannot both take the key
            if (hit := self.get(key)) is not None:
                return "reply", hit
            other = self.claim_of(key)
            if other is not None and other.owner != self.owner and other.alive(time.time()):
                return "wait", other
            self.db.execute(
                "INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?)",
                (key, self.owner, HOST, os.getpid(), time.time() + self.lease_s),
            )
            return "mine", None

    def renew(self) -> None:
        """Extend the lease of every claim this owner holds (its requests are still in flight)."""
        self.db.execute("UPDATE claims SET lease_until = ? WHERE owner = ?", (time.time() + self.lease_s, self.owner))

    def release(self, key: str | None = None) -> None:
        """Give up this owner's claim on `key` (a request that failed), or on every key (None)."""
        if key is None:
            self.db.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))
        else:
            self.db.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (key, self.owner))

    def put(self, key: str, request: dict, reply: dict) -> None:
        with self._write():  # the reply and the end of its claim, together
            self.db.execute(
                "INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    json.dumps(request, sort_keys=True),
                    reply["reply"],
                    reply["prompt_tokens"],
                    reply["completion_tokens"],
                    reply["reasoning_tokens"],
                    reply["latency_s"],
                    time.time(),
                ),
            )
            self.db.execute("DELETE FROM claims WHERE key = ?", (key,))

    def __len__(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM calls").fetchone()[0]

    def close(self) -> None:
        self.db.close()
