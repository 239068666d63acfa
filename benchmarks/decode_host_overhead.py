"""Host time per token that `generate(..., cache_implementation="static")` spends around each replayed decoding step:
what the GPU waits for between replays at batch 1 (transformers' loop reads each step's result on the host).

The benchmark models' layer structure (16 layers of the GDN, KDA or Kimi-Linear benchmark models; the FP8 Qwen3-Next's
48) at tiny widths, on
the CPU, with the captured step stood in by a replay that does nothing (its output is the capture's): what remains is
the host work around it, transformers' loop and this package's (`CudaGraphDecoder.try_step`: the inputs copied into
the graph's buffers, the check that no kept tensor changed, the cache's counters). Split in two: from the end of
transformers' per-step stop check (on a GPU, a synchronisation) to the next replay, which the GPU waits for at batch
1, and from the replay to the stop check, which runs while the GPU computes the step. Also printed: the cost of the
per-step change check, `ChangeWatch.changed()`, against its check at the start of a run (`addresses=True`) and
against asking every kept tensor (`stale()`).

    python benchmarks/decode_host_overhead.py [--tokens 200] [--models gdn kda kimi qwen3-next-fp8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.generation import utils as gen_utils

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flagship_models import (
    QWEN3_NEXT_TINY,
    TINY_FP8_BLOCK,
    ours_config,
    qwen3_next_fields,
    qwen3_next_fp8_setting,
)
from model_configs import GPU_GDN, GPU_KDA, gdn_pair, kda_pair, kimi_linear_config

from hybrid_linear_models import HybridLinearForCausalLM
from hybrid_linear_models.cuda_graph_decoding import CudaGraphDecoder

NARROW = dict(hidden=128, intermediate=256, vocab=500, head_dim=16)


CONFIGS = {
    "gdn": lambda: gdn_pair(**dict(GPU_GDN, **NARROW, gdn_dim=16))[0],
    "kda": lambda: kda_pair(**dict(GPU_KDA, **NARROW, kda_dim=16))[0],
    "kimi": lambda: kimi_linear_config(hidden=128, vocab=500, dense_width=256, expert_width=32, kda_dim=16, kda_heads=2,
                                       mla_heads=2, kv_lora_rank=32, qk_nope=16, qk_rope=16, v_dim=16),
    "qwen3-next-fp8": lambda: _qwen3_next_fp8_narrow(),
}


def _qwen3_next_fp8_narrow():
    """The FP8 Qwen3-Next-80B-A3B's 48 layers (GDN and attention, 512 experts' routing, FP8 layers) at tiny widths."""
    fields = qwen3_next_fields(fp8=True)
    fields.update({k: v for k, v in QWEN3_NEXT_TINY.items() if k != "num_hidden_layers"})
    fields["quantization_config"] = qwen3_next_fp8_setting(TINY_FP8_BLOCK)
    return ours_config(fields)


def _timed_replays(model, ids, settings) -> tuple[float, float]:
    """Median host seconds from the stop check to the next replay, and from a replay to the next stop check."""
    marks: list[tuple[str, float]] = []
    decoder = model._graph_decoder
    decoder.last_graph.replay = lambda: marks.append(("replay", time.perf_counter()))
    check = gen_utils.StopCheck.__call__

    def timed_check(self, *args):
        result = check(self, *args)
        marks.append(("stop", time.perf_counter()))
        return result

    gen_utils.StopCheck.__call__ = timed_check
    try:
        model.generate(ids, **settings)
    finally:
        gen_utils.StopCheck.__call__ = check
    waited = sorted(b - a for (x, a), (y, b) in zip(marks, marks[1:]) if (x, y) == ("stop", "replay"))
    overlapped = sorted(b - a for (x, a), (y, b) in zip(marks, marks[1:]) if (x, y) == ("replay", "stop"))
    return waited[len(waited) // 2], overlapped[len(overlapped) // 2]


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
        waited, overlapped = _timed_replays(model, ids, settings)
    decoder = model._graph_decoder
    watch = decoder._graphs[decoder._last_key].read.watch
    checks = 2000
    timings = []
    for check in (lambda: watch.changed(), lambda: watch.changed(addresses=True),
                  lambda: any(kept.value is not value or kept.stale() for kept, value in watch._pairs)):
        start = time.perf_counter()
        for _ in range(checks):
            check()
        timings.append((time.perf_counter() - start) / checks * 1e3)
    host = per_token - prompt / tokens
    print(f"{name:5s} {len(model.config.layer_types):3d} layers: {host * 1e3:.3f} ms of host time per token around "
          f"the replay: {waited * 1e3:.3f} ms from the stop check to the replay (the GPU waits), "
          f"{overlapped * 1e3:.3f} ms from the replay to the stop check; change check {timings[0]:.4f} ms per "
          f"step, {timings[1]:.4f} ms with the addresses ({len(watch._sources)} sources), {timings[2]:.4f} ms "
          "asking each kept tensor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--models", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    torch.set_num_threads(1)
    # the captured step stood in by a replay that does nothing: only the host work around it is timed
    CudaGraphDecoder.device_types = ("cuda", "cpu")
    CudaGraphDecoder._record = staticmethod(
        lambda run, device, reset, pool=None: (SimpleNamespace(replay=lambda: None, expired=False), run()))
    for name in args.models:
        measure(name, args.tokens)


if __name__ == "__main__":
    main()
