"""Training speed (forward + backward), ours vs transformers, side by side in one run.

GPU (H200, bfloat16 weights, fla kernels on both sides): B=4, T=4096,
- a ~1.2B GDN model (hidden 2048, intermediate 5632, 12 GDN + 4 gated attention layers, attention 16/2 heads of
  256, GDN 16 key / 32 value heads of 128, vocab 32000, dense MLP) against Qwen3NextForCausalLM with the same weights;
- a ~1B KDA model (12 KDA + 4 gated attention layers) against KimiLinearForCausalLM (12 KDA + 4 MLA layers).
Prints tokens/s, the ratio, peak memory and model FLOPs utilisation (6 * non-embedding params * tokens plus
attention's 12 * layers * heads * head_dim * T/2 per token, over 989 TFLOP/s dense bf16).

On the CPU (no CUDA device), `--tiny` runs the same steps on the tiny models in float32 (B=2, T=64, 1 timed step
unless given): a smoke test of this script; the full sizes need a GPU.

    python benchmarks/bench_training.py [--tiny] [--skip-kda] [--steps 5] [--variants ours-recompute ours-logits-loss]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import KimiLinearForCausalLM, Qwen3NextForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from model_configs import GPU_GDN, GPU_KDA, TINY_GDN, TINY_KDA, count_parameters, gdn_pair, kda_pair  # noqa: E402
from timing import timed  # noqa: E402

from hybrid_linear_models import HybridLinearForCausalLM, ops  # noqa: E402
from hybrid_linear_models.fla_backend import fla_training_refusal  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16


def model_flops_per_token(model, config, seq_len: int) -> float:
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    dense = 6 * (count_parameters(model) - embeddings) + 6 * config.vocab_size * config.hidden_size  # + LM head
    attention_layers = sum(t == "full_attention" for t in getattr(config, "layer_types", []))
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    attention = 12 * attention_layers * config.num_attention_heads * head_dim * seq_len / 2
    return dense + attention


def train_steps(model, input_ids, steps: int) -> tuple[float, float]:
    """Median seconds per forward + backward, and peak memory in GiB (nan off CUDA)."""
    times = []
    device = input_ids.device
    for step in range(steps + 2):
        _, seconds = timed(lambda: model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward(),
                           device)
        if step >= 2:  # the first steps autotune fla's kernels
            times.append(seconds)
        model.zero_grad(set_to_none=True)
    times.sort()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return times[len(times) // 2], peak


def _variant(ours, keep_kda_intermediates: bool = True, fused_loss: bool = True) -> None:
    ops.KDA_KEEP_INTERMEDIATES = keep_kda_intermediates
    ours.config.fuse_linear_cross_entropy = fused_loss


# A/B variants of ours, timed in the same run: fla's KDA backward recomputing its intermediates (less memory), and
# the loss from materialised logits instead of fla's fused linear + cross-entropy.
VARIANTS = {"ours-recompute": dict(keep_kda_intermediates=False), "ours-logits-loss": dict(fused_loss=False)}


def run_pair(name, ours, theirs, batch, seq_len, steps, mfu_config, variants=(), device=torch.device("cuda")):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    input_ids = torch.randint(0, ours.config.vocab_size, (batch, seq_len), device=device)
    tokens = batch * seq_len
    results = {}
    runs = [("ours", ours, {}), *((label, ours, VARIANTS[label]) for label in variants), ("transformers", theirs, {})]
    for label, model, variant in runs:
        _variant(ours, **variant)
        model.to(device=device, dtype=dtype).train()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            seconds, peak = train_steps(model, input_ids, steps)
        except torch.OutOfMemoryError:
            seconds, peak = float("nan"), float("nan")
        flops = model_flops_per_token(model, mfu_config if model is ours else model.config, seq_len) * tokens
        results[label] = (tokens / seconds, peak, flops / seconds / PEAK_BF16_FLOPS)
        model.to("cpu")
        print(f"  {label:>16}: {count_parameters(model) / 1e9:.3f}B params, {tokens / seconds:>9.0f} tok/s, "
              f"peak {peak:6.1f} GiB, MFU {100 * results[label][2]:5.1f}%", flush=True)
    _variant(ours)
    ratio = results["ours"][0] / results["transformers"][0]
    print(f"{name}: ours/transformers tokens/s = {ratio:.2f}, peak memory ours/transformers = "
          f"{results['ours'][1] / results['transformers'][1]:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--skip-kda", action="store_true")
    parser.add_argument("--skip-gdn", action="store_true")
    parser.add_argument("--batch", type=int, default=None, help="default 4 (2 with --tiny on the CPU)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 4096 (64 with --tiny on the CPU)")
    parser.add_argument("--steps", type=int, default=None, help="default 5 (1 with --tiny on the CPU)")
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                        help="also time these variants of ours (KDA recomputation, loss from logits)")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        print("no CUDA device: this benchmark measures GPU training throughput (--tiny runs its steps on the CPU)")
        return
    refusal = fla_training_refusal(device)
    if refusal is not None:  # (in the first backward otherwise, after the forward's first-use tuning)
        raise SystemExit(f"bench_training: {refusal}.")
    cpu_smoke = device.type == "cpu"
    if device.type == "cpu":
        # one thread: the smoke run's tensors are tiny, and a second thread waits for a core that
        # other processes hold (CI runs two test workers on two cores)
        torch.set_num_threads(1)
    batch = args.batch or (2 if cpu_smoke else 4)
    seq_len = args.seq_len or (64 if cpu_smoke else 4096)
    steps = args.steps or (1 if cpu_smoke else 5)
    dtype = "bf16" if device.type == "cuda" else "float32"
    torch.manual_seed(0)
    if not args.skip_gdn:
        ours_cfg, theirs_cfg = gdn_pair(**(TINY_GDN if args.tiny else GPU_GDN))
        ours, theirs = HybridLinearForCausalLM(ours_cfg), Qwen3NextForCausalLM(theirs_cfg)
        theirs.load_state_dict(ours.state_dict())
        print(f"GDN, B={batch}, T={seq_len}, {dtype}, {device}")
        run_pair("GDN vs Qwen3-Next", ours, theirs, batch, seq_len, steps, ours_cfg,
                 [v for v in args.variants if v != "ours-recompute"], device)
        del ours, theirs
    if not args.skip_kda:
        ours_cfg, theirs_cfg = kda_pair(**(TINY_KDA if args.tiny else GPU_KDA))
        ours, theirs = HybridLinearForCausalLM(ours_cfg), KimiLinearForCausalLM(theirs_cfg)
        print(f"KDA, B={batch}, T={seq_len}, {dtype}, {device}")
        run_pair("KDA vs Kimi-Linear", ours, theirs, batch, seq_len, steps, ours_cfg, args.variants, device)


if __name__ == "__main__":
    main()
