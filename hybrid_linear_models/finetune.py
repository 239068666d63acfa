"""Fine-tune a hybrid model folder on a text or JSONL dataset with `transformers.Trainer`.

    hybrid-linear-finetune MODEL_DIR DATA OUTPUT_DIR [--max-steps N] [--packing] [--gradient-checkpointing]
                           [--lora] [--merge-lora] [--bf16] ...

DATA is a .txt file (one document per non-empty line) or a .jsonl file (one object per line, text under --text-field).
With --packing, documents are concatenated without padding (`DataCollatorWithFlattening`): position ids restart at
every document and every mixer keeps the documents apart. Multi-GPU runs go through accelerate
(`accelerate launch -m hybrid_linear_models.finetune ...`, DDP or FSDP2 from your accelerate config).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    Trainer,
    TrainingArguments,
)

import hybrid_linear_models  # noqa: F401  (registers the model family)

# Every linear projection of the family, as LoRA targets: attention, MLP, Gated DeltaNet and Kimi Delta Attention.
LORA_TARGET_MODULES = [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "in_proj_qkvz", "in_proj_ba", "out_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj",
]


class TokenizedDocuments(torch.utils.data.Dataset):
    def __init__(self, documents: list[list[int]]):
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.documents[index]}


def read_documents(path: Path, text_field: str = "text") -> list[str]:
    """Documents of a .txt (one per non-empty line) or .jsonl (one JSON object per line) file."""
    if not path.is_file():
        raise SystemExit(f"error: dataset {path} does not exist")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    documents = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise SystemExit(f"error: {path}:{number} is not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise SystemExit(f"error: {path}:{number} has no string field {text_field!r} (see --text-field)")
        documents.append(record[text_field])
    return documents


def tokenize(tokenizer, documents: list[str], max_length: int) -> list[list[int]]:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [(tokenizer(text, add_special_tokens=True)["input_ids"] + eos)[:max_length] for text in documents]


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-linear-finetune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="model folder (config, weights and tokenizer)")
    parser.add_argument("data", type=Path, help=".txt (one document per line) or .jsonl file")
    parser.add_argument("output", type=Path, help="where the fine-tuned model folder is written")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder, if not in the model folder")
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--max-length", type=int, default=2048, help="documents are truncated to this many tokens")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="documents per device and step")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--packing", action="store_true", help="padding-free packing (DataCollatorWithFlattening)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="bfloat16 mixed precision (default: on when CUDA is available)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-alpha", type=int, default=32)
    parser.add_argument("--merge-lora", action="store_true", help="merge the adapters into the saved model")
    parser.add_argument("--report-to", default="none", help="Trainer's report_to (default: none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    documents = tokenize(tokenizer, read_documents(args.data, args.text_field), args.max_length)
    if not documents:
        raise SystemExit(f"error: {args.data} holds no documents")

    bf16 = torch.cuda.is_available() if args.bf16 is None else args.bf16
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    if args.lora:
        from peft import LoraConfig, get_peft_model

        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        targets = [name for name in LORA_TARGET_MODULES if name in present]
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                                 target_modules=targets, task_type="CAUSAL_LM"))
        model.print_trainable_parameters()

    if args.packing:
        collator = DataCollatorWithFlattening(return_position_ids=True)
    else:
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    training_args = TrainingArguments(
        output_dir=str(args.output / "checkpoints"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        logging_steps=args.logging_steps,
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),  # several CPU processes then train with DDP over gloo
        ddp_find_unused_parameters=False,  # every parameter takes part in each step: no extra graph traversal
        activation_checkpointing=args.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
        save_strategy="no",
        report_to=args.report_to,
        seed=args.seed,
        remove_unused_columns=False,
        dataloader_drop_last=False,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=TokenizedDocuments(documents),
                      data_collator=collator)
    trainer.train()

    if args.lora and args.merge_lora:
        model = trainer.model.merge_and_unload()
        model.config.use_cache = True
        model.save_pretrained(args.output)
    else:
        if not args.lora:
            trainer.model.config.use_cache = True
        trainer.save_model(str(args.output))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output)
        print(f"saved the fine-tuned model to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
