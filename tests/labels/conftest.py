"""Every test of labels/ runs with a call cache of its own (HALLUDETECT_CACHE under its tmp_path) and
the fake API key set (support.KEY = support.SECRET): no test reads or writes the user's cache, and
the redaction tests know the secret to look for."""

import pytest
from support import KEY, SECRET


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("HALLUDETECT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(KEY, SECRET)
