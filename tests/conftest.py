"""What every test shares: the shared helper modules on the import path, one CPU thread, the `slow` marker on every
property-based (hypothesis) test, and the copies of a test module's `original` checkpoint folder its tests edit.

`slow` tests run in CI like any other (`python -m pytest -q tests`); `-m "not slow"` leaves them out of a quick run.
Tests that start subprocesses (remote-code loads, two-rank training, the CLI end to end) carry the marker
themselves; fuzzing gets it here, from hypothesis's own flag, so a new property-based test cannot miss it.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/model_helpers.py and the other shared helpers
# One CPU thread per test process, and per subprocess it starts (they inherit OMP_NUM_THREADS): CI runs one xdist
# worker per core, and an op on two threads waits for the core the other worker holds (a depthwise convolution of
# 0.1 ms then takes 25 ms). The tests' tensors are small: a second thread gains little on an idle machine either.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# MKL's float products may round differently with the address alignment of their operands (its "conditional
# numerical reproducibility"): two runs of the same ops on the same values, in buffers allocated elsewhere, then
# differ in the last bits, which the tests that compare a captured path with the uncaptured one bit for bit see.
# Strict mode makes them alignment-independent (read at MKL's first product, so set before any).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def folder(tmp_path: Path, original: Path) -> Path:
    """A writable copy, per test, of the test module's `original` checkpoint folder (a module-scoped fixture)."""
    return Path(shutil.copytree(original, tmp_path / "model"))


@pytest.fixture(scope="module")
def mutable(tmp_path_factory: pytest.TempPathFactory, original: Path):
    """One copy of the test module's `original` folder for its fuzz tests, which replace one file at a time
    (`conversion_helpers.FuzzFolder`)."""
    from conversion_helpers import FuzzFolder

    return FuzzFolder(Path(shutil.copytree(original, tmp_path_factory.mktemp("fuzz") / "model")))
