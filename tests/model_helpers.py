"""Tiny configurations and helpers shared by the model tests."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_helpers import SUBPROCESS_TIMEOUT
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PreTrainedTokenizerFast

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.cuda_graph_decoding import CudaGraphDecoder
from hybrid_linear_models.cuda_graph_prefill import CudaGraphPrefill
from hybrid_linear_models.speculative_decoding import CapturedVerifyRound

ALL_TYPES = ["gated_deltanet", "full_attention", "kimi_delta_attention", "sliding_attention"]


def tiny_config(layer_types=None, **overrides) -> HybridLinearConfig:
    settings = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        layer_types=layer_types or ALL_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        gdn_num_key_heads=2,
        gdn_num_value_heads=4,
        gdn_key_head_dim=16,
        gdn_value_head_dim=8,
        kda_num_heads=2,
        kda_head_dim=16,
        sliding_window=6,
        rms_norm_eps=1e-6,
    )
    settings.update(overrides)
    return HybridLinearConfig(**settings)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Distinct random values everywhere (norm weights and gates included), so mapping mistakes cannot hide."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 - 1)
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
    return model


def forward_backward(block: torch.nn.Module, x: torch.Tensor):
    """A block's output, its input's gradient and its parameters' gradients, under a loss that weighs every output
    element differently (a plain sum would hide a permutation of the outputs)."""
    x = x.clone().requires_grad_(True)
    block.zero_grad()
    out = block(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def experts_implementations_run(monkeypatch) -> list[str]:
    """The experts implementation of every routed-experts forward from here on, in order (a spy on
    `HybridLinearExperts.forward`, undone with the test's monkeypatch)."""
    from hybrid_linear_models.mlp_sparse_moe import HybridLinearExperts

    run: list[str] = []
    original = HybridLinearExperts.forward

    def spy(self, *args, **kwargs):
        run.append(self.config._experts_implementation)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HybridLinearExperts, "forward", spy)
    return run


def tiny_model(layer_types=None, seed: int = 0, **overrides) -> HybridLinearForCausalLM:
    torch.manual_seed(seed)
    return randomize(HybridLinearForCausalLM(tiny_config(layer_types, **overrides)), seed).eval()


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: <pad> = 0 (also the unknown word), <eos> = 1, then `words` from id 2; text is words
    joined by spaces."""
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i for i, w in enumerate(words, 2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # words joined by spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<pad>", pad_token="<pad>", eos_token="<eos>")


# The start of a subprocess script that runs with this package unimportable (what a user without it has): a finder
# placed first refuses it (the editable install's finder comes later in sys.meta_path), and no sys.path entry holds
# it (the subprocess runs from a temporary folder).
WITHOUT_THE_PACKAGE_PRELUDE = """
import importlib.abc, importlib.util, json, sys
from pathlib import Path

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hybrid_linear_models" or name.startswith("hybrid_linear_models."):
            raise ImportError("hybrid_linear_models is blocked in this test")

sys.meta_path.insert(0, Blocker())
sys.path = [p for p in sys.path if not (Path(p or ".") / "hybrid_linear_models").exists()]
try:
    spec = importlib.util.find_spec("hybrid_linear_models")
except ImportError:
    spec = None
assert spec is None, "the package is still importable"
"""


def run_without_the_package(script: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    """Runs the Python `script` with `args` in a subprocess that sees the environment with PYTHONPATH stripped of
    the entries that hold this package (so the checkout's package is importable only if the script allows it; see
    WITHOUT_THE_PACKAGE_PRELUDE, while packages installed on PYTHONPATH, as a GPU machine's newer transformers, stay
    seen), transformers' remote-code modules cached under cwd/modules and the hub offline; asserts that it
    succeeded."""
    environment = dict(os.environ)
    kept = [p for p in environment.pop("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "hybrid_linear_models").exists()]
    if kept:
        environment["PYTHONPATH"] = os.pathsep.join(kept)
    environment.update(HF_MODULES_CACHE=str(cwd / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, str(script), *map(str, args)], check=False, cwd=cwd, env=environment,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def greedy(model: HybridLinearForCausalLM, input_ids: torch.Tensor, new_tokens: int = 8, **kwargs):
    """Greedy generation of exactly `new_tokens` tokens, with every step's logits (`kwargs` override the settings)."""
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                    output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        return model.generate(input_ids, **{**settings, **kwargs})


def assert_same_generation(got, expected, tolerance: float) -> None:
    """The same tokens, and every step's logits within `tolerance` (the caller's, justified there)."""
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def assert_cached_generation_equals_uncached(model: HybridLinearForCausalLM, input_ids: torch.Tensor, cache: str,
                                             tolerance: float, new_tokens: int = 8) -> None:
    """Greedy decoding with a `cache` ("dynamic", "static") gives the tokens and logits of decoding without one."""
    without = greedy(model, input_ids, new_tokens, use_cache=False)
    cached = greedy(model, input_ids, new_tokens, cache_implementation=cache)
    assert_same_generation(cached, without, tolerance)


def assert_padded_and_packed_rows_run_alone(model: HybridLinearForCausalLM, seed: int, tolerance: float) -> None:
    """Two prompts (7 and 4 tokens), run alone, as the rows of a left-padded batch (3 pads) and as two documents
    packed in one row (position_ids restarting at 0): each row and each document gives the logits it gives alone,
    within `tolerance` (the caller's: only the summation order may differ)."""
    generator = torch.Generator().manual_seed(seed)
    a, b = torch.randint(2, 128, (1, 7), generator=generator), torch.randint(2, 128, (1, 4), generator=generator)
    with torch.no_grad():
        alone_a, alone_b = model(a).logits, model(b).logits
        padded = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
        mask = torch.cat([torch.ones(1, 7), torch.cat([torch.zeros(1, 3), torch.ones(1, 4)], 1)]).long()
        batch = model(padded, attention_mask=mask).logits
        positions = torch.cat([torch.arange(7), torch.arange(4)]).unsqueeze(0)
        packed = model(torch.cat([a, b], 1), position_ids=positions).logits
    for got_a, got_b in ((batch[:1], batch[1:, 3:]), (packed[:, :7], packed[:, 7:])):
        torch.testing.assert_close(got_a, alone_a, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(got_b, alone_b, rtol=tolerance, atol=tolerance)


class EagerReplay:
    """Replays `run` eagerly into the output buffer, as a CUDA graph replay refills it; counts its replays."""

    expired = False  # (as a RecordedGraph that its device's others were not destroyed with)

    def __init__(self, run, out):
        self.run, self.out, self.replays = run, out, 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.run())


def replay_graphs_eagerly(monkeypatch) -> list[EagerReplay]:
    """The CUDA-graph decoding path on the CPU: each captured step stood in by an EagerReplay of the same step, so
    what the path adds around the graph runs without a GPU. Returns the captured steps, in capture order."""
    monkeypatch.setattr(CudaGraphDecoder, "device_types", ("cuda", "cpu"))
    captured: list[EagerReplay] = []

    def record(run, device, reset, pool=None):
        run()  # record_graph's warm-up step, undone by the caller as on the GPU (reset: the capture's own run below
        # stands for the first replay, from the same cache)
        reset()
        out = run()
        captured.append(EagerReplay(run, out))
        return captured[-1], out

    monkeypatch.setattr(CudaGraphDecoder, "_record", staticmethod(record))
    return captured


def replay_prefills_eagerly(monkeypatch) -> list[EagerReplay]:
    """The CUDA-graph prefill path on the CPU, each captured prompt bucket stood in by an EagerReplay of the same
    run. Returns the captured prefills, in capture order."""
    monkeypatch.setattr(CudaGraphPrefill, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(CudaGraphPrefill, "on_by_default", True)
    captured: list[EagerReplay] = []

    def record(run, device, pool):
        out = run()
        captured.append(EagerReplay(run, out))
        return captured[-1], out

    monkeypatch.setattr(CudaGraphPrefill, "_record", staticmethod(record))
    return captured


def replay_rounds_eagerly(monkeypatch) -> list:
    """CapturedVerifyRound's capture stood in on the CPU: its warm-up run and its run (the cache put back between
    them, as around a capture), then each replay runs the captured function again into the outputs. Returns the list
    that counts the replays."""
    replays = []

    def record(run, device, reset, pool):
        run()
        reset()
        out = run()

        class Replay:
            expired = False

            def replay(self):
                replays.append(1)
                for target, value in zip(out, run()):
                    target.copy_(value)

        return Replay(), out

    monkeypatch.setattr(CapturedVerifyRound, "_record", staticmethod(record))
    return replays


def compiled_variants(kernel) -> int:
    """How many compiled variants (one per specialisation of its arguments and constexprs) a Triton JIT function
    holds in this process, over every device."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


# this package's Triton kernels run on a GPU, or on a CPU under triton's interpreter (TRITON_INTERPRET=1, triton
# installed): their numeric tests are marked so
runs_triton_kernels = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and CUDA (or TRITON_INTERPRET=1)")


class HostReadsRefused(TorchDispatchMode):
    """Inside it, every op that on a CUDA tensor would wait for the device to hand a value to the host raises (a CUDA
    graph cannot capture such an op, and in eager decoding each one stalls the launch queue): the CPU stands in for
    CUDA. It sees the aten ops (`item`'s `_local_scalar_dense`, `bincount`, which reads its length so, `nonzero`
    behind a boolean index, ...) and Python's reads of a value (int, bool, tolist). `allowed()` lets a block through
    (a CPU reference that reads its offsets on the host)."""

    SYNCING_OPS = frozenset({"aten::_local_scalar_dense", "aten::bincount", "aten::nonzero", "aten::masked_select",
                             "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive"})
    PYTHON_READS = ("__int__", "__bool__", "__index__", "item", "tolist")

    def __init__(self):
        super().__init__()
        self._allowing = 0
        self._patched: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def allowed(self):
        self._allowing += 1
        try:
            yield
        finally:
            self._allowing -= 1

    def _refuse(self, what: str) -> None:
        if not self._allowing:
            raise AssertionError(f"{what} reads a device value on the host (a CUDA graph cannot capture it)")

    def __enter__(self):
        for name in self.PYTHON_READS:
            method = getattr(torch.Tensor, name)
            self._patched.append((name, method))

            def read(tensor, *args, _method=method, _name=name, **kwargs):
                self._refuse(f"Tensor.{_name}")
                return _method(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in reversed(self._patched):
            setattr(torch.Tensor, name, method)
        self._patched.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.SYNCING_OPS:
            self._refuse(func._schema.name)
        return func(*args, **(kwargs or {}))
