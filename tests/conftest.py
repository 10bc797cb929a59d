import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def small_tiles():
    """Chunked tiles that divide none of the test lengths, so every call has several tiles."""
    from selfattn.backends import chunked

    with chunked.options(block_q=32, block_k=48):
        yield chunked
