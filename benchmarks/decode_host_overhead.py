"""Host time per token that `generate(..., cache_implementation="static")` spends around each replayed decoding step:
what the GPU waits for between replays at batch 1 (transformers' loop reads each step's result on the host).

The benchmark models' layer structure (16 layers of the GDN, KDA or Kimi-Linear benchmark models) at tiny widths, on
the CPU, with the captured step stood in by a replay that does nothing (its output is the capture's): what remains is
the host work around it, transformers' loop and this package's (`CudaGraphDecoder.try_step`: the inputs copied into
the graph's buffers, the check that no kept tensor changed, the cache's counters). Also printed: the cost of that
check alone, `ChangeWatch.changed()`, against asking every kept tensor (`stale()`), as before it.

    python benchmarks/decode_host_overhead.py [--tokens 200] [--models gdn kda kimi]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_configs import GPU_GDN, GPU_KDA, gdn_pair, kda_pair, kimi_linear_config

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.cuda_graph_decoding import CudaGraphDecoder

NARROW = dict(hidden=128, intermediate=256, vocab=500, head_dim=16)


CONFIGS = {
    "gdn": lambda: gdn_pair(**dict(GPU_GDN, **NARROW, gdn_dim=16))[0],
    "kda": lambda: kda_pair(**dict(GPU_KDA, **NARROW, kda_dim=16))[0],
    "kimi": lambda: kimi_linear_config(hidden=128, vocab=500, dense_width=256, expert_width=32, kda_dim=16, kda_heads=2,
                                       mla_heads=2, kv_lora_rank=32, qk_nope=16, qk_rope=16, v_dim=16),
}


def measure(name: str, tokens: int) -> None:
    torch.manual_seed(0)
    model = HybridLinearForCausalLM(CONFIGS[name]()).eval()
    ids = torch.randint(1, 100, (1, 8))
    settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                    cache_implementation="static")
    with torch.no_grad():
        model.generate(ids, **settings)  # captured (stood in), warm
        start = time.perf_counter()
        model.generate(ids, **settings)
        per_token = (time.perf_counter() - start) / tokens
        # the prompt's forward, to take out of the total
        start = time.perf_counter()
        model.generate(ids, **dict(settings, max_new_tokens=1, min_new_tokens=1))
        prompt = time.perf_counter() - start
    watch = model._graph_decoder._watch
    checks = 2000
    start = time.perf_counter()
    for _ in range(checks):
        watch.changed()
    fast = (time.perf_counter() - start) / checks
    start = time.perf_counter()
    for _ in range(checks):
        any(kept.value is not value or kept.stale() for kept, value in watch._pairs)
    slow = (time.perf_counter() - start) / checks
    host = per_token - prompt / tokens
    print(f"{name:5s} {len(model.config.layer_types):3d} layers: {host * 1e3:.3f} ms of host time per token around "
          f"the replay; change check {fast * 1e3:.4f} ms ({len(watch._sources)} sources) against {slow * 1e3:.4f} ms "
          f"asking each kept tensor ({slow / fast:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--models", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    torch.set_num_threads(1)
    # the captured step stood in by a replay that does nothing: only the host work around it is timed
    CudaGraphDecoder.device_types = ("cuda", "cpu")
    CudaGraphDecoder._record = staticmethod(lambda run, device: (SimpleNamespace(replay=lambda: None), run()))
    for name in args.models:
        measure(name, args.tokens)


if __name__ == "__main__":
    main()
