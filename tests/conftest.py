import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def small_tiles(monkeypatch):
    """Chunked tiles that divide none of the test lengths, so every run has several tiles."""
    from selfattn.backends import chunked

    monkeypatch.setattr(chunked, "BLOCK_Q", 32)
    monkeypatch.setattr(chunked, "BLOCK_K", 48)
    return chunked
