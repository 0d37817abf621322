"""Who owns a claim: this host's name and whether a process on it is alive. Shared by the two
claim mechanisms, the call cache's leases (core/call_cache.py) and the parts directories' owner
(core/unit_store.py)."""

from __future__ import annotations

import os
import socket

HOST = socket.gethostname()


def pid_alive(pid) -> bool:
    """Whether a process with this id exists on this host (signal 0 checks without sending)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:  # a damaged record (and -1 means "all")
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
