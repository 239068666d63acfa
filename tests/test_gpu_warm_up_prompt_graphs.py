"""`model.warm_up` then static generates of prompt lengths it did not see, on a benchmark-size model, against the same
generates with CUDA graphs off: with the default switches (captured decoding steps, prompts uncaptured), and with
the prompts' graphs on (`set_cuda_graph_decoding(True, prompts=True)`), whose first replay of a prompt shorter than
its bucket after the warm-up's captures raises an illegal memory access on an H200 (cuda_graph_prefill's docstring):
that case is an expected failure until its cause is found, strict, so a fix shows. Each run is a subprocess, so a
device fault fails its test alone, with the child's last lines."""

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

CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "benchmarks")
    from model_configs import GPU_GDN, gdn_pair
    from hybrid_linear_models import HybridLinearForCausalLM
    torch.manual_seed(0)
    config, _ = gdn_pair(**GPU_GDN)
    model = HybridLinearForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    mode, lengths = sys.argv[1], [int(n) for n in sys.argv[2:]]
    model.set_cuda_graph_decoding(mode != "off", prompts=mode == "prompts")
    if mode != "off":
        model.warm_up(max_batch_size=1, max_length=2048)
    for length in lengths:
        ids = torch.randint(1, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            out = model.generate(ids.cuda(), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                                 cache_implementation="static")
        torch.cuda.synchronize()
        print("tokens", length, out[0, length:].tolist(), flush=True)
""")


def _generate(mode: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", CHILD, mode, *map(str, LENGTHS)], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"{mode}: " + "\n".join((result.stdout + result.stderr).splitlines()[-15:])
    return [line for line in result.stdout.splitlines() if line.startswith("tokens")]


def _check(mode: str) -> None:
    graphed, eager = _generate(mode), _generate("off")
    assert len(graphed) == len(eager) == len(LENGTHS)
    # greedy tokens of a random-weight model: bf16 paths may differ in a near tie later on, so the first token (the
    # prefill's: graph replay against the plain forward) is compared exactly
    for a, b in zip(graphed, eager):
        assert a.split()[2] == b.split()[2], (a, b)


def test_static_generates_after_warm_up_run_and_match_graphs_off():
    _check("steps")


@pytest.mark.xfail(strict=True, reason="illegal memory access in the first replay of a prompt graph with padding "
                                       "after warm_up's captures (cuda_graph_prefill's docstring)")
def test_static_generates_after_warm_up_with_prompt_graphs_run_and_match_graphs_off():
    _check("prompts")
