"""`hybrid-linear-convert`: the command line over `hybrid_linear_models.conversion.convert_checkpoint`.

The parser is built from the standard library and the torch-free catalogue of formats alone, and the arguments, SRC
and DST are checked without torch (`conversion_preflight`), so `--help` and a refused conversion answer at once;
torch, transformers and the converters are imported only when a conversion starts.
Expected failures (a bad checkpoint or option, a refused DST, a disk error, Ctrl-C, SIGTERM, SIGHUP) end with one
line on stderr and a non-zero status (1, or 128 + the signal's number); anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from hybrid_linear_cli.conversion_catalogue import DEFAULT_MAX_SHARD_SIZE, DTYPE_NAMES, FORMAT_CATALOGUE, format_size
from hybrid_linear_cli.conversion_preflight import PreflightError, preflight

PROG = "hybrid-linear-convert"


def _epilog() -> str:
    lines = ["formats:"]
    lines += [f"  {entry.name:<22} {entry.description} [{entry.roles}]" for entry in FORMAT_CATALOGUE]
    lines += ["", "examples:",
              f"  {PROG} --from fast_llm --to hf ckpt/export my-model-hf",
              f"  {PROG} --from hf --to fast_llm my-model-hf ckpt/back --dtype float32"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog(),
        description="Convert hybrid linear-attention checkpoints (attention + Gated DeltaNet + Kimi Delta Attention) "
                    "between formats. DST is written into a temporary folder beside it and appears only when "
                    "complete; Ctrl-C, SIGTERM and SIGHUP leave it as it was.",
    )
    readable = [entry.name for entry in FORMAT_CATALOGUE if entry.can_read]
    writable = [entry.name for entry in FORMAT_CATALOGUE if entry.can_write]
    parser.add_argument("--from", dest="from_format", required=True, choices=readable, metavar="FORMAT",
                        help=f"format of SRC: {', '.join(readable)}")
    parser.add_argument("--to", dest="to_format", required=True, choices=writable, metavar="FORMAT",
                        help=f"format of DST: {', '.join(writable)}")
    parser.add_argument("src", metavar="SRC", help="checkpoint folder to read")
    parser.add_argument("dst", metavar="DST", help="folder to create (must not exist unless --force)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="cast the weights to this dtype (default: keep the source dtype)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                        help=f"largest weights file, e.g. 5GB, 500MB, 2GiB (default: {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing DST, if it is empty or holds only a checkpoint of the --to format "
                             "(and only once the new output is complete)")
    with_tokenizer = [entry.name for entry in FORMAT_CATALOGUE if entry.output is not None and entry.output.tokenizer]
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="tokenizer folder (what tokenizer.save_pretrained wrote) to copy into DST, for --to "
                             f"{', '.join(with_tokenizer)} (default: the tokenizer found in SRC, if any)")
    parser.add_argument("--dequantize-fp8", action="store_true",
                        help="convert an FP8 checkpoint's weights (block-scaled, quantization_config quant_method "
                             "fp8) to bfloat16, or to --dtype; without it they stay FP8 with their scales (--to hf, "
                             "qwen3_next)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return parser


class _StderrLines(logging.Handler):
    """The converter's notices (what a run did with the output of a killed one), one line each on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"{PROG}: {record.getMessage()}", file=sys.stderr)


def _convert(args: argparse.Namespace) -> int:
    from hybrid_linear_models.conversion.api import convert_checkpoint
    from hybrid_linear_models.conversion.errors import ConversionError
    from hybrid_linear_models.conversion.interrupts import stop_signals_raise

    notices, handler = logging.getLogger("hybrid_linear_models.conversion"), _StderrLines(logging.WARNING)
    notices.addHandler(handler)
    try:
        with stop_signals_raise():  # SIGTERM / SIGHUP unwind like Ctrl-C; reported by main()
            result = convert_checkpoint(args.src, args.dst, from_format=args.from_format, to_format=args.to_format,
                                        dtype=args.dtype, max_shard_size=args.max_shard_size, force=args.force,
                                        quiet=args.quiet, tokenizer=args.tokenizer,
                                        dequantize_fp8=args.dequantize_fp8)
    except ConversionError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    finally:
        notices.removeHandler(handler)
    if not args.quiet:
        skipped = (f"; skipped {result.skipped} stored tensors that are not weights of the converted model "
                   "(optimizer state, unused supernet mixers)") if result.skipped else ""
        print(f"Converted {result.tensors} tensors ({format_size(result.bytes)}) from {args.from_format} to "
              f"{args.to_format} in {result.seconds:.1f}s: {result.destination}{skipped}")
        writer = next(entry for entry in FORMAT_CATALOGUE if entry.name == args.to_format)
        if writer.output.tokenizer and not result.tokenizer_files:
            from hybrid_linear_models.tokenizer_loading import ADD_TOKENIZER_HINT

            print(f"No tokenizer was found to copy; to use the folder with AutoTokenizer, {ADD_TOKENIZER_HINT}.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # what can be refused without torch is refused before the converters are imported (seconds)
        preflight(args.from_format, args.to_format, args.src, args.dst, force=args.force,
                  max_shard_size=args.max_shard_size, tokenizer=args.tokenizer)
    except PreflightError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    try:
        return _convert(args)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM / SIGHUP raised as `Interrupted`
        signum = getattr(stop, "signum", signal.SIGINT)
        print(f"{PROG}: stopped by {signal.Signals(signum).name}; no partial output was left at DST.",
              file=sys.stderr)
        return 128 + signum
    except OSError as error:  # disk full, permissions: not a bug, but not a bad checkpoint either
        print(f"{PROG}: error: {error}; no partial output was left at DST.", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
