"""Loads the tiny test model with transformers' tensor parallelism (`tp_plan="auto"`) on the ranks of a torchrun
launch and compares it with the unsharded model: logits, greedy decoding (each rank caching its own heads), then the
gradient of every parameter after one backward.
Rank 0 prints the largest differences.

    torchrun --nproc_per_node 2 tests/tensor_parallel_check.py MODEL_DIR [--cuda]

--cuda: one GPU per rank over NCCL (fla's kernels need head dims of at least 16); otherwise CPUs over gloo.
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

import hybrid_linear_models  # noqa: F401
from distributed_helpers import leave  # the script's folder is on sys.path


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def main():
    path, cuda = sys.argv[1], "--cuda" in sys.argv[2:]
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    reference = AutoModelForCausalLM.from_pretrained(path).to(device)
    sharded = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
    assert sharded.device == device, (sharded.device, device)
    layers = {layer.layer_type: layer for layer in sharded.model.layers}
    halved = (  # each rank holds half of these weights' rows
        layers["full_attention"].self_attn.q_proj,
        layers["gated_deltanet"].linear_attn.in_proj_qkvz,
        layers["kimi_delta_attention"].linear_attn.q_proj,
    )
    for module in halved:
        local_rows = module.weight.to_local().shape[0]
        assert local_rows * 2 == full(module.weight).shape[0], (module, local_rows)
    for layer in sharded.model.layers:  # sparse MoE layers: every expert split along its width
        if hasattr(layer.mlp, "experts"):
            experts = layer.mlp.experts
            assert experts.gate_up_proj.to_local().shape[1] * 2 == full(experts.gate_up_proj).shape[1]
            assert experts.down_proj.to_local().shape[2] * 2 == full(experts.down_proj).shape[2]

    input_ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits = (reference(input_ids).logits - sharded(input_ids).logits).abs().max().item()
    generated = [model.generate(input_ids[:, :12], max_new_tokens=8, do_sample=False) for model in (reference, sharded)]
    assert torch.equal(*generated), "greedy decoding with per-rank caches differs from the unsharded model"
    for model in (reference, sharded):
        model.train()
        model(input_ids, labels=input_ids).loss.backward()
    sharded_params = dict(sharded.named_parameters())
    gradients = max(
        ((full(sharded_params[name].grad) - param.grad).abs().max() / param.grad.abs().max()).item()
        for name, param in reference.named_parameters()
    )
    if torch.distributed.get_rank() == 0:
        print(f"MAX_DIFFERENCE {logits} {gradients}")
    torch.distributed.barrier()  # both ranks are done
    leave()


if __name__ == "__main__":
    main()
