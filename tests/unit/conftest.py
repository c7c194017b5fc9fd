"""Fixtures of the unit tier."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The demo tokenizer, built in a private cache root (never the user's ~/.cache)."""
    from toolkit import data
    from toolkit.config import validate
    mp = pytest.MonkeyPatch()
    mp.setenv("TOOLKIT_CACHE_DIR", str(tmp_path_factory.mktemp("toolkit-cache")))
    yield data.load_tokenizer(validate({}))
    mp.undo()
