#!/usr/bin/env bash
# The fine-tuning example on 2 GPUs of one host through accelerate (DDP, and FSDP2), against 1 GPU with the same
# global batch; then Trainer parity runs of the test model (DDP, FSDP2; NCCL) and the tensor-parallel check
# (tp_plan="auto" against the unsharded model), on fla's kernels and on the torch ones. Prints the logged losses of
# each run and the largest differences.
#   usage: [CHECKS_ONLY=1] bash benchmarks/two_gpu_finetune.sh [WORKDIR]     (CHECKS_ONLY skips the example runs)
set -euo pipefail
work=${1:-/tmp/two-gpu}
mkdir -p "$work"
python3 benchmarks/make_finetune_example.py "$work"
common=(--packing --max_steps 30 --logging_steps 5 --learning_rate 1e-3 --seed 0 --bf16 --save_strategy no)
losses() { grep -o "'loss': '\?[0-9.e-]*" | sed "s/'loss': '\?//" | tr '\n' ' '; echo; }

if [ -z "${CHECKS_ONLY:-}" ]; then
echo "== example, 1 GPU, 16 documents per step"
CUDA_VISIBLE_DEVICES=0 python3 -m hybrid_linear_cli.finetune "$work/model" "$work/data.jsonl" "$work/out1" \
  --per_device_train_batch_size 16 "${common[@]}" 2>&1 | tee "$work/one.log" | losses
echo "== example, 2 GPUs (accelerate launch, DDP), 8 documents per GPU and step"
python3 -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision bf16 --dynamo_backend no \
  -m hybrid_linear_cli.finetune "$work/model" "$work/data.jsonl" "$work/out2" --per_device_train_batch_size 8 "${common[@]}" \
  2>&1 | tee "$work/ddp.log" | losses
echo "== example, 2 GPUs (accelerate launch, FSDP2), 8 documents per GPU and step"
python3 -m accelerate.commands.launch --num_processes 2 --num_machines 1 --mixed_precision bf16 --dynamo_backend no --use_fsdp \
  --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP \
  --fsdp_transformer_layer_cls_to_wrap HybridLinearDecoderLayer --fsdp_state_dict_type FULL_STATE_DICT \
  -m hybrid_linear_cli.finetune "$work/model" "$work/data.jsonl" "$work/out3" --per_device_train_batch_size 8 "${common[@]}" \
  2>&1 | tee "$work/fsdp.log" | losses
python3 -c "
import hybrid_linear_models  # the family's classes, so the saved remote code needs no trust prompt
from transformers import AutoModelForCausalLM
for d in ('out1', 'out2', 'out3'):
    m = AutoModelForCausalLM.from_pretrained('$work/' + d)
    print(d, 'loads:', type(m).__name__, sum(p.numel() for p in m.parameters()), 'parameters')" || echo "loading failed"
fi

# The checks below are independent: one failing does not stop the others. Each runs twice: on fla's kernels (which
# multiply in TF32, so runs whose per-rank shapes differ part by ~1e-3 a step) and with fla hidden, on this package's
# float32 torch kernels (where sharding must not change the result beyond float32 rounding).
cd tests
no_fla=$(mktemp -d)  # a stub `fla` that fails to import: the package then takes its torch path, as on a CPU machine
mkdir -p "$no_fla/fla" && echo 'raise ImportError("fla hidden by two_gpu_finetune.sh")' > "$no_fla/fla/__init__.py"
torchrun=(python3 -m torch.distributed.run --nproc_per_node 2 --standalone)
# the tensor-parallel check's model, shared by both passes
python3 -c "
from model_helpers import tiny_model
tiny_model(['full_attention', 'gated_deltanet', 'kimi_delta_attention', 'full_attention'],
           gdn_value_head_dim=16, kda_head_dim=16).save_pretrained('$work/tp-model')"
largest_difference() {  # the largest relative difference of each LOSSES line from the first
  python3 -c "
import json, sys
runs = [json.loads(line.split(' ', 1)[1]) for line in sys.stdin if line.startswith('LOSSES ')]
for run in runs[1:]:
    print('  largest relative difference from 1 GPU:', max(abs(a - b) / abs(b) for a, b in zip(run, runs[0])))"
}
for kernels in fla torch; do
  if [ $kernels = torch ]; then export PYTHONPATH="$no_fla${PYTHONPATH:+:$PYTHONPATH}"; fi
  echo "== Trainer parity (tests/distributed_parity.py, float32, sequential batches, $kernels kernels): 1 GPU x 8, DDP and FSDP2 2 GPUs x 4"
  {
    CUDA_VISIBLE_DEVICES=0 python3 distributed_parity.py --cuda --batch 8 | grep LOSSES || echo "single-GPU parity run failed"
    "${torchrun[@]}" distributed_parity.py --cuda --batch 4 | grep LOSSES || echo "DDP parity run failed"
    "${torchrun[@]}" distributed_parity.py --cuda --batch 4 --fsdp | grep LOSSES || echo "FSDP2 parity run failed"
  } | tee "$work/parity-$kernels.log"
  largest_difference < "$work/parity-$kernels.log"

  echo "== tensor parallelism (tests/tensor_parallel_check.py, tp_plan='auto', NCCL, $kernels kernels): sharded vs unsharded, float32"
  "${torchrun[@]}" tensor_parallel_check.py "$work/tp-model" --cuda | grep MAX_DIFFERENCE || echo "tensor-parallel check failed"
done
rm -rf "$no_fla"
