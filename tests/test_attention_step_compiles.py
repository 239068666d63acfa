"""The fused attention step's kernels (kernels_attention_step_triton) compile once per head layout, whatever the static
cache's length: generation makes a cache of prompt plus new tokens per call, and kernels keyed on that length would
compile again, for seconds, at the first step of every new prompt length.

Two views of it. The key triton files a compiled kernel under (its binder's specialisation of every argument: the
constexprs, the integers' value 1 and divisibility by 16, the pointers' alignment) is one for every length: on a GPU
from the kernel's own binder, under triton's interpreter from the binder `JITFunction` makes of the kernel's source
and decorator options for a CUDA target (the interpreter itself compiles nothing and keys nothing; the kernels are
not run there). And on a GPU (`gpu`-marked, skipped without CUDA) the compiled kernels in each kernel's cache are
counted, the kernels run at every length.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from model_helpers import runs_triton_kernels

KERNELS = ("_prepare_kernel", "_attend_kernel", "_combine_kernel")
# one slot, around tiles of 32, 64 and 128 slots (the tile sizes of `AttendSettings`), several splits of one tile, past
# the split limits (several tiles a split)
LENGTHS = (1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4097, 16385)
# (heads, kv heads, head dim, batch): a group of 2 with a mask row per batch row, the GDN benchmark's 16/2 x 256 (the
# combine's splits then loaded in two chunks) with one mask row for the batch
HEAD_LAYOUTS = {"gqa2_d16_batch2": (4, 2, 16, 2), "gqa8_d256_batch1": (16, 2, 256, 1)}


def _kernels():
    from hybrid_linear_models import kernels_attention_step_triton

    return kernels_attention_step_triton


def _step_arguments(slots: int, layout: str, device: str) -> tuple:
    """attention_step's arguments for a static cache of `slots` slots, the step at its last slot."""
    heads, kv_heads, D, batch = HEAD_LAYOUTS[layout]
    dtype = torch.float16
    qkv = torch.randn(batch, 1, heads * D * 2 + 2 * kv_heads * D, device=device, dtype=dtype)  # gated queries
    keys = torch.randn(batch, kv_heads, slots, D, device=device, dtype=dtype)
    values = torch.randn(batch, kv_heads, slots, D, device=device, dtype=dtype)
    slot = torch.tensor(slots - 1, device=device)
    cos, sin = torch.ones(1, 1, D, device=device, dtype=dtype), torch.zeros(1, 1, D, device=device, dtype=dtype)
    scales = torch.ones(D, device=device, dtype=dtype), torch.ones(D, device=device, dtype=dtype)
    mask = torch.zeros(batch, 1, slots, device=device, dtype=dtype)
    return (qkv, keys, values, slot, *scales, (1e-6, 1e-6), cos.expand(batch, 1, D), sin.expand(batch, 1, D), D // 2, mask,
            D ** -0.5, heads, True)


def _binder(kernel):
    """The function that binds a launch's arguments and returns triton's specialisation of them (the cache key of
    the compiled kernel, with the launch options)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel.device_caches[torch.cuda.current_device()][-1]
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = JITFunction(kernel.fn, **kernel.kwargs)  # the interpreted kernel's source and decorator options
    return create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))


@pytest.mark.gpu
@runs_triton_kernels
@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_one_compiled_kernel_key_for_every_cache_length(layout, monkeypatch):
    """Each of the three kernels is launched under one specialisation key for caches of every length in LENGTHS (odd,
    multiples of 16, one slot, one and two tiles a split)."""
    kernels = _kernels()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = {name: set() for name in KERNELS}
    grids = set()
    for name in KERNELS:
        binder = _binder(getattr(kernels, name))

        def recorded(*args, grid, warmup, name=name, binder=binder, **kwargs):
            _, specialisation, options = binder(*args, **kwargs)
            keys[name].add((tuple(specialisation), str(options)))
            grids.add((name, tuple(grid)))

        monkeypatch.setattr(getattr(kernels, name), "run", recorded)  # launches recorded, not run
    for slots in LENGTHS:
        kernels.attention_step(*_step_arguments(slots, layout, device))
    assert len({grid for name, grid in grids if name == "_attend_kernel"}) > 3  # the lengths' split counts differ
    for name in KERNELS:
        assert len(keys[name]) == 1, (name, sorted(keys[name], key=str))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="compiled kernels need CUDA and triton (the interpreter compiles nothing)")
@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_kernels_compile_once_for_every_cache_length(layout):
    """After the step at one cache length, the steps at every other length in LENGTHS compile nothing: the number of
    compiled kernels in each kernel's cache stays as it was."""
    kernels = _kernels()
    device = torch.cuda.current_device()

    def compiled() -> dict[str, int]:
        return {name: len(getattr(kernels, name).device_caches[device][0]) for name in KERNELS}

    kernels.attention_step(*_step_arguments(LENGTHS[0], layout, "cuda"))
    after_first = compiled()
    for slots in LENGTHS[1:]:
        kernels.attention_step(*_step_arguments(slots, layout, "cuda"))
    torch.cuda.synchronize()
    assert compiled() == after_first
