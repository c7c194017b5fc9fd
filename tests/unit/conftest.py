"""Fixtures of the unit tier."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The demo tokenizer, built in a private cache root (never the user's ~/.cache)."""
    from toolkit import data
    from toolkit.config import validate
    # Only while it is built: a session-long TOOLKIT_CACHE_DIR would move every later test's caches on
    # this worker (the JIT-built DeepSpeed ops among them: a 30-80 s rebuild).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOOLKIT_CACHE_DIR", str(tmp_path_factory.mktemp("toolkit-cache")))
        return data.load_tokenizer(validate({}))
