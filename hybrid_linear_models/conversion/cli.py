"""`hybrid-linear-convert`: the command line over `convert_checkpoint`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .api import DEFAULT_MAX_SHARD_SIZE, DTYPES, convert_checkpoint
from .errors import ConversionError
from .formats import FORMATS

PROG = "hybrid-linear-convert"


def _format_help() -> str:
    lines = ["formats:"]
    for fmt in FORMATS.values():
        roles = "/".join(role for role, able in (("read", fmt.can_read), ("write", fmt.can_write)) if able)
        lines.append(f"  {fmt.name:<22} {fmt.description} [{roles}]")
    lines += ["", "examples:",
              f"  {PROG} --from fast_llm --to hf ckpt/export my-model-hf",
              f"  {PROG} --from hf --to fast_llm my-model-hf ckpt/back --dtype float32"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_format_help(),
        description="Convert hybrid linear-attention checkpoints (attention + Gated DeltaNet + Kimi Delta Attention) "
                    "between formats. DST is written into a temporary folder beside it and appears only when "
                    "complete.",
    )
    readable = [name for name, fmt in FORMATS.items() if fmt.can_read]
    writable = [name for name, fmt in FORMATS.items() if fmt.can_write]
    parser.add_argument("--from", dest="from_format", required=True, choices=readable, metavar="FORMAT",
                        help=f"format of SRC: {', '.join(readable)}")
    parser.add_argument("--to", dest="to_format", required=True, choices=writable, metavar="FORMAT",
                        help=f"format of DST: {', '.join(writable)}")
    parser.add_argument("src", metavar="SRC", help="checkpoint folder to read")
    parser.add_argument("dst", metavar="DST", help="folder to create (must not exist unless --force)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="cast the weights to this dtype (default: keep the source dtype)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                        help=f"largest weights file, e.g. 5GB, 500MB, 2GiB (default: {DEFAULT_MAX_SHARD_SIZE})")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing DST (only once the new output is complete)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = convert_checkpoint(args.src, args.dst, from_format=args.from_format, to_format=args.to_format,
                                    dtype=args.dtype, max_shard_size=args.max_shard_size, force=args.force,
                                    quiet=args.quiet)
    except ConversionError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written to {args.dst}.", file=sys.stderr)
        return 130
    except OSError as error:  # disk full, permissions: not a bug, but not a bad checkpoint either
        print(f"{PROG}: error: {error}; nothing was written to {args.dst}.", file=sys.stderr)
        return 1
    if not args.quiet:
        skipped = f"; skipped {result.skipped} optimizer-state tensors" if result.skipped else ""
        print(f"Converted {result.tensors} tensors ({result.bytes / 1e6:,.1f} MB) from {args.from_format} to "
              f"{args.to_format} in {result.seconds:.1f}s: {result.destination}{skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
