#!/usr/bin/env bash
# The fine-tuning example on 2 GPUs of one host through accelerate (DDP, and FSDP2), against 1 GPU with the same
# global batch, and Trainer parity runs of the test model (DDP, FSDP2; NCCL). Prints the logged losses of each run.
#   usage: bash benchmarks/two_gpu_finetune.sh [WORKDIR]
set -euo pipefail
work=${1:-/tmp/two-gpu}
mkdir -p "$work"
python3 benchmarks/make_finetune_example.py "$work"
common=(--packing --max-steps 30 --logging-steps 5 --learning-rate 1e-3 --seed 0 --bf16)
losses() { grep -o "'loss': '\?[0-9.e-]*" | sed "s/'loss': '\?//" | tr '\n' ' '; echo; }

echo "== example, 1 GPU, 16 documents per step"
CUDA_VISIBLE_DEVICES=0 python3 -m hybrid_linear_models.finetune "$work/model" "$work/data.jsonl" "$work/out1" \
  --batch-size 16 "${common[@]}" 2>&1 | tee "$work/one.log" | losses
echo "== example, 2 GPUs (accelerate launch, DDP), 8 documents per GPU and step"
accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision bf16 --dynamo_backend no \
  -m hybrid_linear_models.finetune "$work/model" "$work/data.jsonl" "$work/out2" --batch-size 8 "${common[@]}" \
  2>&1 | tee "$work/ddp.log" | losses
echo "== example, 2 GPUs (accelerate launch, FSDP2), 8 documents per GPU and step"
accelerate launch --num_processes 2 --num_machines 1 --mixed_precision bf16 --dynamo_backend no --use_fsdp \
  --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP \
  --fsdp_transformer_layer_cls_to_wrap HybridLinearDecoderLayer --fsdp_state_dict_type FULL_STATE_DICT \
  -m hybrid_linear_models.finetune "$work/model" "$work/data.jsonl" "$work/out3" --batch-size 8 "${common[@]}" \
  2>&1 | tee "$work/fsdp.log" | losses
python3 -c "
from transformers import AutoModelForCausalLM
for d in ('out1', 'out2', 'out3'):
    m = AutoModelForCausalLM.from_pretrained('$work/' + d)
    print(d, 'loads:', type(m).__name__, sum(p.numel() for p in m.parameters()), 'parameters')"

echo "== Trainer parity (tests/distributed_parity.py, float32, sequential batches): 1 GPU x 8, 2 GPUs x 4"
cd tests
python3 distributed_parity.py --cuda --batch 8 | grep LOSSES
torchrun --nproc_per_node 2 --standalone distributed_parity.py --cuda --batch 4 | grep LOSSES
torchrun --nproc_per_node 2 --standalone distributed_parity.py --cuda --batch 4 --fsdp | grep LOSSES
