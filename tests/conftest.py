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


@pytest.fixture(autouse=True)
def own_caches(monkeypatch, tmp_path_factory):
    """Engines loaded by tests keep what they keep across runs (the pair's acceptance counts, draft records, twins) in
    folders of the test's own, never the user's $OFFSPEC_HOME (which the demo models are read from)."""
    from offspec.engine import draft_records, pair_cache
    from offspec.model import twin_store
    drafts, home, twins = (tmp_path_factory.mktemp(name) for name in ("drafts", "home", "twins"))
    monkeypatch.setattr(draft_records, "records_dir", lambda: drafts)
    monkeypatch.setattr(pair_cache, "default_home", lambda: home)
    monkeypatch.setattr(twin_store, "twins_dir", lambda: twins)
