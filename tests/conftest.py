import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from torchvision_ops import define_torchvision_ops

define_torchvision_ops()  # before anything imports torchvision (timm, vit_pytorch, open_clip, transformers)


@pytest.fixture
def small_tiles():
    """Chunked tiles that divide none of the test lengths, so every call has several tiles."""
    from selfattn.backends import chunked

    with chunked.options(block_q=32, block_k=48):
        yield chunked


def _hypothesis_profiles() -> None:
    """'ci' (default): fixed seed, bounded, no database. 'fuzz': random, long, with the database under
    .hypothesis/ (chosen with SELFATTN_FUZZ=1 or --hypothesis-profile=fuzz)."""
    import os

    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                        HealthCheck.filter_too_much])
    # the default run: 120 examples per property, to keep the suite near 5 minutes on 2 cores; make fuzz searches on
    settings.register_profile("ci", max_examples=int(os.environ.get("SELFATTN_EXAMPLES", "120")), derandomize=True,
                              database=None, print_blob=True, **common)
    settings.register_profile("fuzz", max_examples=int(os.environ.get("SELFATTN_EXAMPLES", "2000")),
                              database=DirectoryBasedExampleDatabase(".hypothesis/examples"), print_blob=True,
                              **common)
    settings.load_profile("fuzz" if os.environ.get("SELFATTN_FUZZ") else "ci")


_hypothesis_profiles()
