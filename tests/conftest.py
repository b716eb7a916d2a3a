import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))   # tests import tiny.py (model builders) directly
if not torch.cuda.is_available():   # the Triton kernels' tests run them on the CPU, interpreted (test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (the README's test command: two workers, a file each) each worker computes on one thread: the
# two share the machine's cores, and most tests are Python-bound tiny models.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def nan_filled_caches(monkeypatch):
    """Every KV cache a test makes starts full of NaN, not whatever memory held: offspec does not zero its
    caches (kv_cache.uninitialized), so a slot read before it is written, even masked off, must turn the
    outputs to NaN in every test rather than pass on memory that happened to be zero."""
    from offspec.model import kv_cache
    monkeypatch.setattr(kv_cache, "uninitialized",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))
