"""`model.warm_up` then static generates of prompt lengths it did not see, on a benchmark-size model, against the same
generates with CUDA graphs off: with the default switches (captured decoding steps, prompts uncaptured), and with
the prompts' graphs on (`set_cuda_graph_decoding(True, prompts=True)`): replays of prompts shorter than their
buckets after the warm-up's captures, at batch 1, then at batch 1 and 4 after a warm-up of both up to 4,096 tokens,
the scenario in which these replays have raised an illegal memory access on an H200 (cuda_graph_prefill's
docstring). Each run is a subprocess, so a device fault fails its test alone, with the child's last lines."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = [1000, 1500, 700]  # each inside a captured bucket (1,024, 1,536, 768) and shorter than it
# the warm-up of batches 1 and 4 up to 4,096 tokens, then 16 lengths at both batch sizes (cuda_graph_prefill.py)
MANY_LENGTHS = [43, 97, 150, 260, 333, 517, 700, 1000, 1234, 1500, 1777, 2100, 2500, 2900, 3333, 3858]

CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "benchmarks")
    from model_configs import GPU_GDN, gdn_pair
    from hybrid_linear_models import HybridLinearForCausalLM
    torch.manual_seed(0)
    config, _ = gdn_pair(**GPU_GDN)
    model = HybridLinearForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    mode, batches, lengths = sys.argv[1], eval(sys.argv[2]), [int(n) for n in sys.argv[3:]]
    model.set_cuda_graph_decoding(mode != "off", prompts=mode == "prompts")
    if mode != "off":
        model.warm_up(max_batch_size=max(batches), batch_sizes=batches, max_length=2048 if batches == [1] else 4096)
    for batch in batches:
        for length in lengths:
            ids = torch.randint(1, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(length))
            with torch.no_grad():
                out = model.generate(ids.cuda(), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                                     cache_implementation="static")
            torch.cuda.synchronize()
            print("tokens", batch, length, out[:, length].tolist(), flush=True)
""")


def _generate(mode: str, batches: list[int], lengths: list[int]) -> list[str]:
    result = subprocess.run([sys.executable, "-c", CHILD, mode, repr(batches), *map(str, lengths)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, f"{mode}: " + "\n".join((result.stdout + result.stderr).splitlines()[-15:])
    return [line for line in result.stdout.splitlines() if line.startswith("tokens")]


def _check(mode: str, batches: list[int], lengths: list[int]) -> None:
    graphed, eager = _generate(mode, batches, lengths), _generate("off", batches, lengths)
    assert len(graphed) == len(eager) == len(batches) * len(lengths)
    # greedy tokens of a random-weight model: bf16 paths may differ in a near tie later on, so each row's first token
    # (the prefill's: graph replay against the plain forward) is compared, and all but one row in 50 must agree
    rows = [(a.split(" ", 3)[3], b.split(" ", 3)[3]) for a, b in zip(graphed, eager)]
    firsts = [(x, y) for a, b in rows for x, y in zip(eval(a), eval(b))]
    assert sum(x != y for x, y in firsts) <= len(firsts) // 50, (graphed, eager)


def test_static_generates_after_warm_up_run_and_match_graphs_off():
    _check("steps", [1], LENGTHS)


def test_static_generates_after_warm_up_with_prompt_graphs_run_and_match_graphs_off():
    _check("prompts", [1], LENGTHS)


def test_prompt_graphs_at_batch_1_and_4_after_a_warm_up_of_both_run_and_match_graphs_off():
    _check("prompts", [1, 4], MANY_LENGTHS)
