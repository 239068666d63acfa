"""Loads the tiny test model with transformers' tensor parallelism (`tp_plan="auto"`) on the ranks of a
torchrun launch and prints the largest logit difference against the unsharded model, on rank 0.

    torchrun --nproc_per_node 2 tests/tensor_parallel_check.py MODEL_DIR
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM

import hybrid_linear_models  # noqa: F401


def main():
    path = sys.argv[1]
    torch.distributed.init_process_group("gloo")
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    sharded = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    sharded_q = sharded.model.layers[0].self_attn.q_proj.weight
    assert sharded_q.to_local().shape[0] * 2 == reference.model.layers[0].self_attn.q_proj.weight.shape[0]
    input_ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (reference(input_ids).logits - sharded(input_ids).logits).abs().max().item()
    if torch.distributed.get_rank() == 0:
        print(f"MAX_DIFFERENCE {difference}")
    torch.distributed.barrier()  # both ranks are done
    leave()


def leave() -> None:
    """Exits at once. Destroying the DDP / gloo objects (when main's locals go, or at interpreter shutdown) sometimes
    hangs, about 1 run in 10 here; the work is done and flushed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
