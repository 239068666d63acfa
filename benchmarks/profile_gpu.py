"""Where the GPU time goes: torch.profiler tables of ours and transformers' models side by side, for one training
step (B=4, T=4096), one batch-1 prefill of 1024 tokens, and one eager batch-1 decoding step, in bf16; then, for ours,
the time of one replay of the captured decoding graph against the time per token inside `generate` (the difference
is the host's share: generate's loop, logits processing, synchronisation).

    python benchmarks/profile_gpu.py [--kda] [--tiny] [--rows 30] [--what training prefill decode graph]

Without CUDA (a smoke test, with --tiny): the CPU profiles of the training step (B=2, T=64), the prefill (T=64) and
the eager decoding step, float32; the graph replay needs CUDA and is skipped with a line saying so.

Each table lists the top CUDA kernels by total GPU time, then the totals: GPU busy time against wall time shows
whether a phase is bound by the GPU or by launching kernels from Python.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, KimiLinearForCausalLM, Qwen3NextForCausalLM, StaticCache

sys.path.insert(0, str(Path(__file__).parent))
from model_configs import GPU_GDN, GPU_KDA, TINY_GDN, TINY_KDA, gdn_pair, kda_pair  # noqa: E402
from timing import synchronize, timed  # noqa: E402

from hybrid_linear_models import HybridLinearForCausalLM  # noqa: E402


def training_step(model, input_ids):
    model.train()
    model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)


def prefill(model, input_ids, cache):
    model.eval()
    with torch.no_grad():
        model(input_ids=input_ids, cache=cache, use_cache=True)


def decode_step(model, token, cache):
    with torch.no_grad():
        model(input_ids=token, cache=cache, use_cache=True)


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke test with --tiny


def profiled(label: str, fn, rows: int, cpu_rows: int = 0) -> None:
    for _ in range(2):  # warm-up: fla autotuning, cuBLAS handles
        fn()
    synchronize(DEVICE)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        _, wall = timed(fn, DEVICE)
    events = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in events) / 1e3
    kernels = sum(e.count for e in events if e.self_device_time_total > 0)
    print(f"\n===== {label}: wall {wall * 1e3:.1f} ms, GPU busy {gpu_total:.1f} ms, {kernels} kernel launches")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
    if cpu_rows:  # where the host's time goes (launch-bound phases)
        print(events.table(sort_by="self_cpu_time_total", row_limit=cpu_rows, max_name_column_width=70))


def time_graph_decoding(model, ids, new_tokens: int = 128) -> None:
    replays = 100  # each replay writes one more token into the cache: leave room for them after the generation
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens + replays + 8)
    kwargs = dict(do_sample=False, pad_token_id=0, cache=cache)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, **kwargs)  # captures the graph
        times = []
        for tokens in (1, new_tokens):
            cache.reset()
            times.append(timed(lambda: model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs),
                               ids.device)[1])
        per_token = (times[1] - times[0]) / (new_tokens - 1)
        graph = model._graph_decoder.last_graph
        replay = timed(lambda: [graph.replay() for _ in range(replays)], ids.device)[1] / replays
    print(f"\n===== ours graph decoding B=1: {per_token * 1e3:.3f} ms per token in generate, "
          f"{replay * 1e3:.3f} ms per graph replay (host share {100 * (1 - replay / per_token):.0f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kda", action="store_true", help="the KDA model against Kimi-Linear (default: GDN)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--what", nargs="*", default=["training", "prefill", "decode", "graph"])
    args = parser.parse_args()
    torch.manual_seed(0)
    device = DEVICE
    if args.kda:
        ours_cfg, theirs_cfg = kda_pair(**(TINY_KDA if args.tiny else GPU_KDA))
        models = {"ours": HybridLinearForCausalLM(ours_cfg), "transformers": KimiLinearForCausalLM(theirs_cfg)}
    else:
        ours_cfg, theirs_cfg = gdn_pair(**(TINY_GDN if args.tiny else GPU_GDN))
        models = {"ours": HybridLinearForCausalLM(ours_cfg), "transformers": Qwen3NextForCausalLM(theirs_cfg)}
        models["transformers"].load_state_dict(models["ours"].state_dict())
    vocab = ours_cfg.vocab_size
    for name, model in models.items():
        model.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        if "training" in args.what:
            ids = torch.randint(0, vocab, (4, 4096) if device.type == "cuda" else (2, 64), device=device)
            profiled(f"{name} training step B={ids.shape[0]} T={ids.shape[1]}", lambda: training_step(model, ids),
                     args.rows)
        ids = torch.randint(0, vocab, (1, 1024 if device.type == "cuda" else 64), device=device)
        if "prefill" in args.what:
            def run_prefill():
                cache = (StaticCache(config=model.config, max_cache_len=ids.shape[1] + 128) if name == "ours"
                         else DynamicCache(config=model.config))
                prefill(model, ids, cache)
            profiled(f"{name} prefill B=1 T={ids.shape[1]}", run_prefill, args.rows, cpu_rows=20)
        if "decode" in args.what:
            cache = DynamicCache(config=model.config)
            prefill(model, ids, cache)
            token = ids[:, -1:]
            profiled(f"{name} eager decoding step B=1", lambda: decode_step(model, token, cache), args.rows,
                     cpu_rows=20)
        if "graph" in args.what and name == "ours":
            if device.type == "cuda":
                time_graph_decoding(model, ids)
            else:
                print("\n===== ours graph decoding: skipped, a CUDA-graph replay needs a CUDA device")
        model.to("cpu")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
