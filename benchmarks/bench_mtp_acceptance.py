"""Speculative-decoding acceptance and speed of a small model of this family trained here: its own MTP head
(`generate(use_mtp=k)`) and prompt lookup (`generate(prompt_lookup_num_tokens=n)`) against the same model decoding
plainly, greedy, on held-out text.

Data: the `.py` files of this machine's Python standard library (site-packages and test folders left out), sorted
and split by file: every 10th file is held out, never trained on. Tokenizer: a byte-level BPE of 4096 tokens
(`tokenizers`), trained on the training files alone (seconds). A BPE rather than raw bytes, because within a word
most bytes follow from the ones before, so a byte model's acceptance would be higher than any real tokenizer's; the
BPE's figures are closer to what a deployed model sees. `--tokenizer bytes` gives the byte-level figures.

Model: 6 Gated DeltaNet + 2 full-attention layers (hidden 512), one MTP layer (`num_mtp_layers=1`; with
`--mtp-type fast_llm`, Fast-LLM's parallel heads, max(--mtp-k) copies of the last layer), trained from scratch for
`--train-seconds` (wall clock, first-call kernel compilation included) with AdamW, bf16 autocast on CUDA and a fixed
seed, on random windows of the training files; a fraction of the windows (`--copy-fraction`) are the copy task
below, built from training files, so that the model learns the task prompt lookup is measured on. The loss is the
next-token loss plus `mtp_loss_weight` x the MTP loss (the mean of its depths' losses). Printed: ten progress lines
with the held-out losses of a few windows (the stdlib is ~3M tokens: a long run overfits); the weights of the line
with the lowest held-out losses are kept (early stopping). Then the train losses and the held-out next-token and MTP
losses of the kept weights.

Evaluation, greedy, the model in bf16 on CUDA (float32 on the CPU), prompts from held-out files:
- plain decoding: `generate` with `cache_implementation="dynamic"`, eager; and with `cache_implementation="static"`
  (generate's default on CUDA), whose one-token steps replay captured CUDA graphs on CUDA (the fastest plain path);
- MTP: `generate(use_mtp=k)`, k = 1..4 drafts a round, at batch 1 and 8 (batched speculative decoding, its rounds
  replayed from a captured CUDA graph on CUDA; transformers' assisted decoding at batch 1 on the CPU);
- prompt lookup on the copy task (prompt = a held-out chunk, an instruction line, the chunk's first tokens; the model
  goes on copying): `generate(prompt_lookup_num_tokens=n)` at batch 1 and 8 (8 rows: batched speculative decoding).
tokens/s counts new tokens over wall time (after an untimed warm-up run of each configuration). Acceptance length:
tokens gained per verify forward of the model (the accepted drafts + 1), from a hook on the model's final norm that
records each forward's tokens; the prompt's forward is a round only where it holds drafts too (transformers' prompt
lookup drafts from the prompt); at batch 8, the tokens each row gains per round the batch runs. Each
speculative output is compared with plain greedy decoding token for token (greedy speculative decoding keeps the
model's own argmax; in bf16 a verify forward of several tokens rounds differently from one-token steps, so a
near-tie may flip: the check prints where; `--eval-dtype float32` makes that rarer).

    python benchmarks/bench_mtp_acceptance.py                        # the full run on CUDA: 2 min training + eval
    python benchmarks/bench_mtp_acceptance.py --save /tmp/mtp-model  # ... and keep the model (safetensors)
    python benchmarks/bench_mtp_acceptance.py --load /tmp/mtp-model  # evaluate a kept model, no training
    python benchmarks/bench_mtp_acceptance.py --tiny                 # the CPU smoke run (figures meaningless)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import sysconfig
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_configs import hybrid_layer_types
from timing import timed

from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.configuration_hybrid_linear import MTP_TYPES
from hybrid_linear_models.fla_backend import fla_training_refusal
from hybrid_linear_models.speculative_decoding import (
    CapturedVerifyRound,
    ReportReader,
    VerifyRound,
)

PAD, EOS = 0, 1  # the special tokens: padding, and the end of a file in the training stream
SPECIAL_TOKENS = ["<pad>", "<eos>"]
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
LOSS_MEAN_STEPS = 20  # the printed train losses: the mean over the last steps
COPY_INSTRUCTION = "\n# Rewrite the code above, unchanged:\n"
MODEL_SIZES = {  # (hidden, intermediate, layers, attention heads, key-value heads, head dim, GDN heads and dims)
    "gpu": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 64, "gdn_num_key_heads": 4, "gdn_num_value_heads": 8,
            "gdn_key_head_dim": 64, "gdn_value_head_dim": 64},
    "tiny": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "gdn_num_key_heads": 2, "gdn_num_value_heads": 4,
             "gdn_key_head_dim": 16, "gdn_value_head_dim": 16},
}


# ------------------------------------------------------------------------------------------------------------ data


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's `.py` files under `root` (this interpreter's by default), sorted, without
    site-packages and test folders."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    return [path for path in sorted(root.rglob("*.py"))
            if not SKIPPED_FOLDERS & set(path.relative_to(root).parts[:-1])]


def split_files(files: Sequence[Path], held_out_every: int = 10) -> tuple[list[Path], list[Path]]:
    """(training, held-out): every `held_out_every`-th file of the sorted list held out, the rest trained on."""
    ordered = sorted(files)
    held = [path for index, path in enumerate(ordered) if index % held_out_every == held_out_every - 1]
    kept = set(held)
    return [path for path in ordered if path not in kept], held


def read_texts(files: Sequence[Path]) -> list[str]:
    return [path.read_text(encoding="utf-8", errors="replace") for path in files]


class ByteTokenizer:
    """Bytes as tokens, shifted past the special tokens: vocabulary 256 + 2."""

    vocab_size = 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        return [byte + len(SPECIAL_TOKENS) for byte in text.encode("utf-8")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]


class BpeTokenizer:
    """A byte-level BPE (`tokenizers`) with the special tokens at ids 0 and 1."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int) -> BpeTokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(texts, trainer)
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]


def training_stream(documents: Sequence[list[int]]) -> torch.Tensor:
    """The documents' tokens end to end, each followed by EOS: [N]."""
    return torch.tensor([token for document in documents for token in [*document, EOS]], dtype=torch.long)


def copy_prompt(chunk: Sequence[int], instruction: Sequence[int], lead: int) -> list[int]:
    """The copy task's prompt: the chunk, the instruction, then the chunk's first `lead` tokens (the model goes on
    with the rest of the chunk)."""
    if not 0 < lead < len(chunk):
        raise ValueError(f"lead={lead}: the copy prompt repeats 1 to {len(chunk) - 1} tokens of a {len(chunk)}-token "
                         "chunk; pass a smaller --copy-lead or a longer --copy-chunk.")
    return [*chunk, *instruction, *chunk[:lead]]


def random_windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` windows of `length` tokens at random offsets of the stream: [batch, length]."""
    starts = torch.randint(0, stream.numel() - length + 1, (batch,), generator=generator)
    return torch.stack([stream[start: start + length] for start in starts.tolist()]) if batch else \
        torch.empty(0, length, dtype=torch.long)


def copy_windows(stream: torch.Tensor, instruction: Sequence[int], batch: int, length: int,
                 generator: torch.Generator) -> torch.Tensor:
    """`batch` copy-task rows of `length` tokens: a random chunk, the instruction, the chunk again (cut at length)."""
    chunk = (length - len(instruction)) // 2 + 1
    rows = [copy_prompt(window.tolist(), instruction, chunk - 1) + window[-1:].tolist()
            for window in random_windows(stream, batch, chunk, generator)]
    return torch.tensor([(row + [PAD] * length)[:length] for row in rows], dtype=torch.long).view(batch, length)


def held_out_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` windows of `length` tokens evenly spaced over the held-out stream (the same ones every run)."""
    count = max(1, min(count, stream.numel() // length))
    step = (stream.numel() - length) // count
    return torch.stack([stream[i * step: i * step + length] for i in range(count)])


# ----------------------------------------------------------------------------------------------------------- model


def build_config(size: str, vocab_size: int, mtp_loss_weight: float, mtp_type: str = "qwen3_next",
                 max_drafts: int = 1) -> HybridLinearConfig:
    """3 Gated DeltaNet : 1 full-attention layers, dense MLPs; one MTP layer of Qwen3-Next's kind (applied
    recursively to draft several tokens), or `max_drafts` of Fast-LLM's (one draft each)."""
    shape = dict(MODEL_SIZES[size])
    layers = shape.pop("num_hidden_layers")
    return HybridLinearConfig(vocab_size=vocab_size, layer_types=hybrid_layer_types(layers, "gated_deltanet"),
                              num_mtp_layers=1 if mtp_type == "qwen3_next" else max_drafts, mtp_type=mtp_type,
                              mtp_loss_weight=mtp_loss_weight, pad_token_id=PAD, rms_norm_eps=1e-6,
                              tie_word_embeddings=False, **shape)


@dataclass
class TrainingResult:
    """What a training run did: its steps, seconds and tokens, and its mean losses over the last steps."""

    steps: int
    seconds: float
    tokens: int
    loss: float
    mtp_loss: float


def learning_rate(peak: float, progress: float, warmup: float = 0.05) -> float:
    """Linear warm-up over the first `warmup` of training, then cosine decay to a tenth of the peak."""
    if progress < warmup:  # (the first step at a small rate, not 0)
        return peak * max(progress, warmup / 100) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


def train(model: HybridLinearForCausalLM, stream: torch.Tensor, instruction: Sequence[int], args,
          device: torch.device, held_windows: torch.Tensor) -> TrainingResult:
    """AdamW on random windows (a `copy_fraction` of them copy-task rows) for `train_seconds` or `steps`; each of
    the ten progress lines gives the held-out losses of `held_windows` too, and the weights of the line with the
    lowest sum of the two are the ones kept (early stopping: the stdlib is small, and a longer run overfits it)."""
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    weight = model.config.mtp_loss_weight
    copies = round(args.batch_size * args.copy_fraction)
    model.train()
    start, step, tokens, next_log = time.perf_counter(), 0, 0, 0.0
    last: list[torch.Tensor] = []  # (loss, MTP loss) of the last steps, kept on the device (no synchronisation)
    log_every = max(1, args.steps // 10) if args.steps else None
    best = (math.inf, 0, None)  # (held-out loss + MTP loss, step, weights on the device) of the best progress line
    while True:
        progress = step / args.steps if args.steps else (time.perf_counter() - start) / args.train_seconds
        if progress >= 1:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.lr, progress)
        ids = torch.cat([random_windows(stream, args.batch_size - copies, args.context, generator),
                         copy_windows(stream, instruction, copies, args.context, generator)]).to(device)
        labels = ids.masked_fill(ids == PAD, -100)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + ids.numel()
        last = [*last[-(LOSS_MEAN_STEPS - 1):], torch.stack([out.loss - weight * out.mtp_loss, out.mtp_loss]).detach()]
        elapsed = time.perf_counter() - start
        if (step % log_every == 0) if log_every else (elapsed >= next_log):
            loss, mtp = last[-1].tolist()
            held, held_mtp = held_out_losses(model, held_windows, device)
            if held + held_mtp < best[0]:
                best = (held + held_mtp, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            model.train()
            print(f"  step {step:5d}  {elapsed:6.1f} s  lr {optimizer.param_groups[0]['lr']:.1e}  loss {loss:.3f}  "
                  f"MTP loss {mtp:.3f}  held out {held:.3f} / {held_mtp:.3f}  {tokens / elapsed:,.0f} tokens/s",
                  flush=True)
            next_log = elapsed + args.train_seconds / 10
    loss, mtp = torch.stack(last).float().mean(0).tolist()
    seconds = time.perf_counter() - start
    if best[2] is not None and best[1] != step:
        model.load_state_dict(best[2])
        print(f"  kept the weights of step {best[1]} (the progress line of the lowest held-out losses)")
    return TrainingResult(step, seconds, tokens, loss, mtp)


@torch.no_grad()
def held_out_losses(model: HybridLinearForCausalLM, windows: torch.Tensor, device: torch.device,
                    batch: int = 8) -> tuple[float, float]:
    """Mean next-token and MTP losses over the held-out windows."""
    model.eval()
    weight = model.config.mtp_loss_weight
    losses, mtp_losses = [], []
    for rows in windows.split(batch):
        rows = rows.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=rows, labels=rows, use_cache=False)
        losses.append(out.loss.item() - weight * out.mtp_loss.item())
        mtp_losses.append(out.mtp_loss.item())
    return statistics.mean(losses), statistics.mean(mtp_losses)


# ------------------------------------------------------------------------------------------------------ evaluation


@dataclass
class Run:
    """A configuration's outputs (one [B, P + N] tensor per call), new tokens, seconds, and its verify rounds."""

    outputs: list[torch.Tensor]
    new_tokens: int
    seconds: float
    rounds: int  # forwards of the model that verified drafts, over all calls
    round_tokens: int  # the tokens each row gained in them, summed over the calls

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def acceptance(self) -> float:
        """Mean acceptance length: tokens a row gains per verify round (its accepted drafts + 1)."""
        return self.round_tokens / self.rounds if self.rounds else float("nan")


def verify_rounds(forward_lengths: Sequence[int], prompt: int, new_tokens: int) -> tuple[int, int]:
    """(verify rounds, tokens a row gained in them) of one call, from the token counts of its forwards: the prompt's
    forward is a round when it holds drafts too (more tokens than the prompt: transformers' prompt lookup drafts from
    the prompt), else it gives the first token alone."""
    if forward_lengths and forward_lengths[0] > prompt:
        return len(forward_lengths), new_tokens
    return len(forward_lengths) - 1, new_tokens - 1


@contextmanager
def counted_forwards(model: HybridLinearForCausalLM) -> Iterator[list[int]]:
    """The token count of each forward of the model (its final norm's input; the norm runs once a forward: plain
    steps, prompts, verify rounds; the MTP head has a norm of its own). The batched loop's verify rounds
    (speculative_decoding.VerifyRound: a captured graph's replay runs no Python) count instead when the host reads
    their tokens (`ReportReader.pop`): a round run ahead of the last read, whose tokens no row keeps, is not one, nor
    are the runs that record a graph."""
    lengths: list[int] = []
    quiet: list[int] = []  # inside a round's capture or replay: counted by the read of its tokens instead
    handle = model.model.norm.register_forward_hook(
        lambda module, inputs, output: None if quiet else lengths.append(inputs[0].shape[1]))

    def quietly(method):
        def run(self, *args, **kwargs):
            quiet.append(1)
            try:
                return method(self, *args, **kwargs)
            finally:
                quiet.pop()
        return run

    pop = ReportReader.pop

    def counted_pop(self):
        rows = pop(self)
        lengths.append(len(rows[0]) - 1)  # (each row: kept, then the round's k greedy tokens)
        return rows

    try:
        with mock.patch.object(CapturedVerifyRound, "__init__", quietly(CapturedVerifyRound.__init__)), \
                mock.patch.object(CapturedVerifyRound, "replay", quietly(CapturedVerifyRound.replay)), \
                mock.patch.object(VerifyRound, "replay", quietly(VerifyRound.replay)), \
                mock.patch.object(ReportReader, "pop", counted_pop):
            yield lengths
    finally:
        handle.remove()


def generate_runs(model: HybridLinearForCausalLM, batches: Sequence[torch.Tensor], new_tokens: int,
                  **options) -> Run:
    """Greedy `generate` of each batch of prompts [B, P] (equal lengths, no padding): an untimed warm-up call on the
    first, then each timed."""
    device = model.device
    settings = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD,
                    eos_token_id=None, **options)
    with torch.no_grad():
        model.generate(batches[0].to(device), **settings)
        outputs, seconds, rounds, round_tokens = [], 0.0, 0, 0
        for ids in batches:
            ids = ids.to(device)
            with counted_forwards(model) as lengths:
                out, elapsed = timed(lambda: model.generate(ids, **settings), device)
            seconds += elapsed
            call_rounds, call_tokens = verify_rounds(lengths, ids.shape[1], out.shape[1] - ids.shape[1])
            rounds, round_tokens = rounds + call_rounds, round_tokens + call_tokens
            outputs.append(out.cpu())
    new = sum(out.shape[0] * (out.shape[1] - ids.shape[1]) for out, ids in zip(outputs, batches))
    return Run(outputs, new, seconds, rounds, round_tokens)


def first_difference(outputs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], prompt: int) -> str:
    """'equal' when every row matches the reference token for token, else how many do and where the first row
    that differs (counted over all the calls' rows) does."""
    pairs = [(a, b) for out, ref in zip(outputs, reference) for a, b in zip(out, ref)]
    where = None
    same = 0
    for row, (a, b) in enumerate(pairs):
        length = min(a.numel(), b.numel())
        differ = (a[:length] != b[:length]).nonzero().flatten()
        if differ.numel() == 0 and a.numel() == b.numel():
            same += 1
        elif where is None:
            where = f"row {row}: new token {(int(differ[0]) if differ.numel() else length) - prompt}"
    return "equal" if same == len(pairs) else f"{same}/{len(pairs)} rows equal ({where})"


def copied_fraction(outputs: Sequence[torch.Tensor], chunks: Sequence[list[int]], prompt: int, lead: int) -> float:
    """How much of the rest of each chunk the copy task's new tokens reproduce before their first difference, mean
    over the rows."""
    fractions = []
    rows = [row for out in outputs for row in out]
    for row, chunk in zip(rows, chunks):
        target = torch.tensor(chunk[lead:])
        new = row[prompt: prompt + target.numel()]
        match = (new == target[: new.numel()]).long().cumprod(0).sum().item()
        fractions.append(match / target.numel())
    return statistics.mean(fractions)


def ngrams_from_chunks(outputs: Sequence[torch.Tensor], chunks: Sequence[list[int]], prompt: int, n: int = 4) -> float:
    """The fraction of the new tokens' n-grams found in the row's chunk: copying, also where the copy skips or
    repeats a part (which `copied_fraction` stops at)."""
    found = total = 0
    rows = [row.tolist() for out in outputs for row in out]
    for row, chunk in zip(rows, chunks):
        grams = {tuple(chunk[i: i + n]) for i in range(len(chunk) - n + 1)}
        new = row[prompt:]
        for i in range(len(new) - n + 1):
            found, total = found + (tuple(new[i: i + n]) in grams), total + 1
    return found / total if total else 0.0


def repeated_ngrams(outputs: Sequence[torch.Tensor], prompt: int, n: int = 4) -> float:
    """The fraction of the new tokens' n-grams that occurred earlier in the same row (prompt included): a model
    that loops repeats most, and its drafts are then easy to accept (a high acceptance from a weak model)."""
    repeated = total = 0
    for row in (row.tolist() for out in outputs for row in out):
        seen = {tuple(row[i: i + n]) for i in range(max(0, prompt - n + 1))}
        for i in range(max(0, prompt - n + 1), len(row) - n + 1):
            gram = tuple(row[i: i + n])
            repeated, total = repeated + (gram in seen), total + 1
            seen.add(gram)
    return repeated / total if total else 0.0


def batched(rows: Sequence[list[int]], size: int) -> list[torch.Tensor]:
    return [torch.tensor(rows[i: i + size], dtype=torch.long) for i in range(0, len(rows), size)]


def row_label(name: str, batch: int, k: str, run: Run, plain: Run, graphs: Run, check: str,
              acceptance: bool = True) -> str:
    """A table row: tokens/s, its ratio to both plain runs, the acceptance length, the output check."""
    ratio = lambda base: f"{run.tokens_per_second / base.tokens_per_second:.2f}x"
    accepted = f"{run.acceptance:.2f}" if acceptance else "-"
    return (f"| {name} | {batch} | {k} | {run.tokens_per_second:,.0f} | {ratio(plain)} | {ratio(graphs)} | "
            f"{accepted} | {check} |")


# ------------------------------------------------------------------------------------------------------------ main


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke run: tiny model, few steps and tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer", choices=["bpe", "bytes"], default="bpe")
    parser.add_argument("--vocab-size", type=int, default=4096, help="the BPE's vocabulary")
    parser.add_argument("--train-seconds", type=float, default=120.0, help="training wall time")
    parser.add_argument("--steps", type=int, default=0, help="train this many steps instead of --train-seconds")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=512, help="training window, tokens")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--mtp-loss-weight", type=float, default=0.3)
    parser.add_argument("--copy-fraction", type=float, default=0.2, help="training rows that are the copy task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (batch 1: one call each)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--mtp-k", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--mtp-type", choices=MTP_TYPES, default="qwen3_next",
                        help="the MTP head trained: Qwen3-Next's one layer, or Fast-LLM's heads (max(--mtp-k) of them)")
    parser.add_argument("--copy-chunk", type=int, default=224,
                        help="the copy task's chunk, tokens (its prompt and copy within the training context)")
    parser.add_argument("--copy-lead", type=int, default=16, help="chunk tokens repeated in the copy prompt")
    parser.add_argument("--lookup-tokens", type=int, nargs="+", default=[10], help="prompt lookup's draft length")
    parser.add_argument("--eval-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the model's dtype in the evaluation on CUDA (float32 on the CPU)")
    parser.add_argument("--save", type=Path, help="save the trained model and tokenizer here (safetensors)")
    parser.add_argument("--load", type=Path, help="evaluate the model and tokenizer saved here (no training)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.device = "cpu"
        args.vocab_size, args.batch_size, args.context = min(args.vocab_size, 300), 4, 48
        args.steps = args.steps or 3
        args.prompts, args.prompt_tokens, args.new_tokens = 2, 16, 8
        args.copy_chunk, args.copy_lead = 24, 4
        args.lookup_tokens = [4]
    return args


def check_arguments(args: argparse.Namespace) -> None:
    """One line for a request this script cannot run, before any work."""
    problems = [
        (not args.load and args.steps <= 0 and args.train_seconds <= 0, "pass --steps or --train-seconds > 0"),
        (not 0 <= args.copy_fraction <= 1, f"--copy-fraction {args.copy_fraction} must be in [0, 1]"),
        (args.load is not None and not (args.load / "config.json").is_file(),
         f"--load {args.load} holds no config.json: pass a folder this script wrote with --save"),
        (any(not 1 <= k <= 4 for k in args.mtp_k), f"--mtp-k {args.mtp_k}: MTP drafts 1 to 4 tokens a round"),
        (any(not 1 <= n <= 63 for n in args.lookup_tokens),
         f"--lookup-tokens {args.lookup_tokens}: prompt lookup drafts 1 to 63 tokens a round"),
        (not 0 < args.copy_lead < args.copy_chunk, "--copy-lead must be between 0 and --copy-chunk"),
        (args.prompts < 1 or args.new_tokens < 2 or args.prompt_tokens < 1,
         "--prompts, --prompt-tokens must be >= 1 and --new-tokens >= 2"),
        (args.device.startswith("cuda") and not torch.cuda.is_available(),
         "--device cuda without a CUDA device: pass --device cpu"),
    ]
    for failed, message in problems:
        if failed:
            raise SystemExit(f"bench_mtp_acceptance.py: {message}.")


def load_or_build(args, train_texts: list[str], device: torch.device):
    """The tokenizer and model: loaded from --load, else the tokenizer trained and the model freshly built."""
    if args.load is not None:
        bpe_file = args.load / "tokenizer.json"
        if bpe_file.is_file():
            from tokenizers import Tokenizer

            tokenizer = BpeTokenizer(Tokenizer.from_file(str(bpe_file)))
        else:
            tokenizer = ByteTokenizer()
        model = HybridLinearForCausalLM.from_pretrained(args.load, dtype=torch.float32)
        if not model.config.num_mtp_layers:
            raise SystemExit(f"bench_mtp_acceptance.py: the model in {args.load} has no MTP head (num_mtp_layers 0); "
                             "pass a folder this script wrote with --save.")
        if model.config.mtp_type != "qwen3_next" and max(args.mtp_k) > model.config.num_mtp_layers:
            raise SystemExit(f"bench_mtp_acceptance.py: the model in {args.load} has {model.config.num_mtp_layers} "
                             f"Fast-LLM MTP heads (one draft each); pass --mtp-k up to that, not {args.mtp_k}.")
        return tokenizer, model.to(device)
    start = time.perf_counter()
    tokenizer = ByteTokenizer() if args.tokenizer == "bytes" else BpeTokenizer.train(train_texts, args.vocab_size)
    print(f"tokenizer: {args.tokenizer}, {tokenizer.vocab_size} tokens ({time.perf_counter() - start:.1f} s)")
    torch.manual_seed(args.seed)
    config = build_config("tiny" if args.tiny else "gpu", tokenizer.vocab_size, args.mtp_loss_weight, args.mtp_type,
                          max(args.mtp_k))
    return tokenizer, HybridLinearForCausalLM(config).to(device)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_arguments(argv)
    check_arguments(args)
    device = torch.device(args.device)
    refusal = fla_training_refusal(device) if args.load is None else None
    if refusal is not None:  # (in the first backward otherwise, after minutes of the forward's first-use tuning)
        raise SystemExit(f"bench_mtp_acceptance: {refusal}.")
    wall = time.perf_counter()
    files = stdlib_files()
    train_files, held_files = split_files(files)
    if args.tiny:
        train_files, held_files = train_files[:8], held_files[:6]
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    print(f"data: {sysconfig.get_paths()['stdlib']} (Python {platform.python_version()}): {len(train_files)} "
          f"training files ({sum(map(len, train_texts)) / 1e6:.1f} MB), {len(held_files)} held out")
    tokenizer, model = load_or_build(args, train_texts, device)
    train_stream = training_stream(tokenizer.encode_batch(train_texts))
    held_documents = tokenizer.encode_batch(held_texts)
    held_stream = training_stream(held_documents)
    instruction = tokenizer.encode(COPY_INSTRUCTION)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters / 1e6:.1f}M parameters ({sum(p.numel() for p in model.mtp.parameters()) / 1e6:.1f}M "
          f"in the MTP head), {model.config.num_hidden_layers} layers {model.config.mixer_types}, hidden "
          f"{model.config.hidden_size}, vocab {model.config.vocab_size}; tokens: {train_stream.numel():,} training, "
          f"{held_stream.numel():,} held out; device {device}")

    if args.load is None:
        print(f"training: batch {args.batch_size} x {args.context} tokens, "
              f"{f'{args.steps} steps' if args.steps else f'{args.train_seconds:.0f} s'}, lr {args.lr}, "
              f"mtp_loss_weight {model.config.mtp_loss_weight}, copy rows {args.copy_fraction:.0%}, seed {args.seed}")
        result = train(model, train_stream, instruction, args, device, held_out_windows(held_stream, 8, args.context))
        print(f"trained: {result.steps} steps, {result.seconds:.0f} s, {result.tokens:,} tokens "
              f"({result.tokens / train_stream.numel():.1f} epochs); train loss {result.loss:.3f}, "
              f"train MTP loss {result.mtp_loss:.3f} (mean of the last steps, copy rows included)")
    loss, mtp_loss = held_out_losses(model, held_out_windows(held_stream, 64, args.context), device)
    print(f"held out: loss {loss:.3f}, MTP loss {mtp_loss:.3f} (the mean of its depths': token t + d + 1)")
    if args.save is not None:
        model.save_pretrained(args.save)
        if isinstance(tokenizer, BpeTokenizer):
            tokenizer.tokenizer.save(str(args.save / "tokenizer.json"))
        (args.save / "benchmark_settings.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}))
        print(f"saved: {args.save}")

    model = model.to(getattr(torch, args.eval_dtype) if device.type == "cuda" else torch.float32).eval()
    succeeded = evaluate(model, held_documents, instruction, args)
    print(f"total: {time.perf_counter() - wall:.0f} s")
    if not succeeded:
        raise SystemExit("bench_mtp_acceptance.py: a speculative configuration failed (its row and traceback above).")


TABLE_HEADER = ("| decoding | batch | k | tokens/s | vs plain | vs plain, static cache | acceptance length | "
                "output vs plain greedy |\n|---|---|---|---|---|---|---|---|")
TABLE_FOOTER = ("vs plain: tokens/s over plain generate's with cache_implementation='dynamic'; vs plain, static "
                "cache: over cache_implementation='static' (captured CUDA-graph steps on CUDA). MTP and prompt lookup "
                "run batched speculative decoding above batch 1, and at batch 1 on CUDA (captured rounds). Goals: MTP "
                ">= 1.8x plain at batch 1, prompt lookup >= 2x on the copy task.")


class Table:
    """The rows of one configuration group: plain decoding (dynamic and static cache) measured first, then each
    speculative configuration against both, printed as it is measured (a later failure keeps the rows before it)."""

    def __init__(self, model: HybridLinearForCausalLM, inputs: list[torch.Tensor], new_tokens: int, prefix: str):
        self.model, self.inputs, self.new_tokens, self.prefix = model, inputs, new_tokens, prefix
        self.batch, self.prompt = inputs[0].shape
        self.plain = generate_runs(model, inputs, new_tokens, cache_implementation="dynamic")
        self.graphs = generate_runs(model, inputs, new_tokens, cache_implementation="static")
        print(row_label(f"{prefix}plain", self.batch, "-", self.plain, self.plain, self.graphs, "-", False), flush=True)
        print(row_label(f"{prefix}plain, static cache", self.batch, "-", self.graphs, self.plain, self.graphs,
                        first_difference(self.graphs.outputs, self.plain.outputs, self.prompt), False), flush=True)

    def speculative(self, name: str, k: int, **options) -> bool:
        """Measures `generate(**options)` and prints its row; a failure prints its row with the error (and the
        traceback on stderr) and returns False."""
        try:
            run = generate_runs(self.model, self.inputs, self.new_tokens, **options)
        except Exception as error:  # noqa: BLE001  (a failure is a result: printed, the others still run)
            traceback.print_exc()
            print(f"| {self.prefix}{name} | {self.batch} | {k} | failed: {type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''} |", flush=True)
            return False
        print(row_label(f"{self.prefix}{name}", self.batch, str(k), run, self.plain, self.graphs,
                        first_difference(run.outputs, self.plain.outputs, self.prompt)), flush=True)
        return True


def evaluation_documents(held_documents: list[list[int]], args) -> list[list[int]]:
    """`--prompts` held-out files long enough for both tasks, spread over the held-out list."""
    needed = max(args.prompt_tokens, args.copy_chunk)
    long_enough = [d for d in held_documents if len(d) >= needed]
    if len(long_enough) < args.prompts:
        raise SystemExit(f"bench_mtp_acceptance.py: {len(long_enough)} held-out files have {needed} tokens, "
                         f"--prompts asks for {args.prompts}; pass fewer --prompts or shorter --prompt-tokens / "
                         "--copy-chunk.")
    return long_enough[:: len(long_enough) // args.prompts][: args.prompts]


def evaluate(model: HybridLinearForCausalLM, held_documents: list[list[int]], instruction: list[int], args) -> bool:
    """The plain, MTP and prompt-lookup runs, printed as one table; False when a configuration failed."""
    documents = evaluation_documents(held_documents, args)
    batch = min(8, args.prompts)
    chunks = [d[: args.copy_chunk] for d in documents]
    copies = [copy_prompt(chunk, instruction, args.copy_lead) for chunk in chunks]
    copy_new = args.copy_chunk - args.copy_lead
    print(f"\nevaluation, greedy, {model.dtype}: {args.prompts} held-out prompts of {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens; copy task: prompts of {len(copies[0])} tokens ({args.copy_chunk}-token "
          f"chunk, instruction, its first {args.copy_lead}), {copy_new} new tokens")
    print("speculative decoding against plain greedy decoding of the same model (k: drafts per round)")
    print(TABLE_HEADER)
    succeeded = []
    prompts = [d[: args.prompt_tokens] for d in documents]
    for size in (1, batch):
        table = Table(model, batched(prompts, size), args.new_tokens, "")
        if size == 1:
            repetition = repeated_ngrams(table.plain.outputs, args.prompt_tokens)
        succeeded += [table.speculative("MTP", k, use_mtp=k) for k in args.mtp_k]
    copied = None
    for size in (1, batch):
        table = Table(model, batched(copies, size), copy_new, "copy: ")
        if copied is None:
            copied = (copied_fraction(table.plain.outputs, chunks, len(copies[0]), args.copy_lead),
                      ngrams_from_chunks(table.plain.outputs, chunks, len(copies[0])))
        succeeded += [table.speculative("prompt lookup", n, prompt_lookup_num_tokens=n) for n in args.lookup_tokens]
    print(TABLE_FOOTER)
    print(f"plain greedy outputs of the MTP prompts: {repetition:.0%} of their new 4-grams occurred earlier in the row "
          "(a looping model's drafts are easy to accept)")
    print(f"copy task: plain greedy reproduces {copied[0]:.0%} of the chunks' rest before its first difference; "
          f"{copied[1]:.0%} of its new 4-grams are in the chunk")
    return all(succeeded)


if __name__ == "__main__":
    main()
