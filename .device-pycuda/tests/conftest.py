import os
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed():
    """A fresh, printed seed per test: every run draws new inputs, and a failure can be replayed
    with FLASHATTN_TEST_SEED."""
    seed = int(os.environ.get("FLASHATTN_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    print(f"seed {seed} (FLASHATTN_TEST_SEED={seed} replays it)")
