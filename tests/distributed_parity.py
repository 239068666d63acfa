"""Trains the tiny test model for a few steps with transformers.Trainer and prints the logged losses as JSON.

Run as one process (`python tests/distributed_parity.py --batch 8`) or several
(`torchrun --nproc_per_node 2 tests/distributed_parity.py --batch 4 [--fsdp]`): with sequential sampling the global
batches are the same documents, so the losses and the trained weights must match.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))
from distributed_helpers import leave
from model_helpers import tiny_model


class SequentialTrainer(Trainer):
    """Documents in order: with several ranks, accelerate deals consecutive batches to the ranks, so a global step
    holds the same documents as one batch of the single-process run."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank (NCCL) instead of the CPU (gloo)")
    parser.add_argument("--moe", action="store_true", help="sparse MoE MLPs in three of the four layers")
    args = parser.parse_args()
    torch.manual_seed(0)
    # on GPUs fla's kernels need head dims of at least 16
    dims = dict(gdn_value_head_dim=16, kda_head_dim=16, head_dim=16) if args.cuda else {}
    if args.moe:  # no aux loss: it pools each rank's tokens, so 2 ranks x 4 documents cannot equal 1 x 8
        dims.update(mlp_types=["sparse_moe", "sparse_moe", "dense", "sparse_moe"], num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    model = tiny_model(**dims).train()
    # equal-length documents: every rank then averages over the same number of tokens
    documents = [[2 + (start + 3 * i) % 126 for i in range(16)] for start in range(64)]
    training = TrainingArguments(
        output_dir="unused", per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=3e-3,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, remove_unused_columns=False,
        use_cpu=not args.cuda, fsdp=args.fsdp, fsdp_config={"version": 2} if args.fsdp else None,
        ddp_backend=("nccl" if args.cuda else "gloo") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        ddp_find_unused_parameters=False,  # every parameter takes part in each step, as in the fine-tuning script
    )
    trainer = SequentialTrainer(model=model, args=training, train_dataset=Dataset.from_dict({"input_ids": documents}),
                                data_collator=DataCollatorWithFlattening(return_position_ids=True))
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print("LOSSES " + json.dumps(losses))
        if args.output:
            trainer.save_model(str(args.output))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # both ranks are done
    leave()


if __name__ == "__main__":
    main()
