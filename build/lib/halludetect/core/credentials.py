"""Secrets that must never be in params: a key pasted where the name of its variable belongs
(`api_key_env`), a password or token written into an endpoint's `base_url`.

params.yaml is versioned, copied into experiments and echoed by error messages, so a secret in
it leaks; the key belongs in the environment, and `api_key_env` names the variable. Both checks
answer *why* a value is refused, never the value itself: the caller prefixes the params key.
This module imports nothing heavy, so `config.py` and `core/endpoint.py` both use it.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a shell can export
# A provider's key prefix (OpenAI, Stripe-like, Hugging Face, GitHub, GitLab, Slack) and a long
# run of key characters after it: `hf_token` is a name, `hf_AbC...` (34 characters) is a key.
KEY_PREFIX = re.compile(r"(sk|pk|rk|hf|ghp|gho|ghu|ghs|github_pat|glpat|xox[abprs])[-_][A-Za-z0-9_-]{16,}")
SECRET_PARAMETER = re.compile(r"key|token|secret|passw|pwd|sig|auth|credential|session", re.IGNORECASE)


def _looks_like_key(value: str) -> bool:
    """A key, not a variable's name: a known prefix, or long and random-looking (names are words
    joined by underscores, mostly in one case; keys mix cases and digits, or run without a break)."""
    if KEY_PREFIX.match(value):
        return True
    mixed = any(c.islower() for c in value) and any(c.isupper() for c in value)
    return len(value) >= 24 and any(c.isdigit() for c in value) and (mixed or "_" not in value)


def key_variable_problem(name: str) -> str | None:
    """Why `name` cannot be the name of the environment variable holding a key, or None."""
    if VARIABLE.fullmatch(name) and not _looks_like_key(name):
        return None
    return (
        "not the name of an environment variable (it may be a key itself: it is not repeated here). "
        "The key goes in the environment (export OPENAI_API_KEY=...) and api_key_env names the "
        "variable (api_key_env: OPENAI_API_KEY); if the key was pasted here, remove it and rotate it"
    )


def url_credentials(url: str) -> str | None:
    """Why `url` carries a credential (a user name or password before the host, a key-like query
    parameter), or None. Only the query parameter's name is said, never a value."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None  # not a URL at all: the caller's own check says so
    if "@" in parts.netloc:
        found = "a user name or password before the host (user:password@)"
    else:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        secret = [k for k, v in pairs if SECRET_PARAMETER.search(k) or _looks_like_key(k) or _looks_like_key(v)]
        if not secret:
            return None  # e.g. Azure's api-version=...
        name = secret[0]
        shown = f" (parameter '{name}')" if VARIABLE.fullmatch(name) and not _looks_like_key(name) else ""
        found = f"a credential in its query{shown}"
    return (
        f"carries {found}, not repeated here. A secret in params leaks (the file is versioned and "
        "printed): remove it from the URL, put the key in an environment variable and name that "
        "variable in api_key_env"
    )
