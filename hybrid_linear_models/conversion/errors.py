"""The one exception type the converters raise for problems with their inputs or options."""

from __future__ import annotations


class ConversionError(Exception):
    """An expected failure (bad input, unsupported config, refused output): the message says what is wrong and how
    to fix it. The CLI prints it on one line, without a traceback."""


__all__ = ["ConversionError"]
