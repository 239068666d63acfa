"""User-supplied values in error messages, bounded: a hostile config, metadata file or path must not turn an error
message into megabytes (or into minutes of repr work), and a message must stay on one line.

- `brief(value)`: repr() of any value, at most ~100 characters. reprlib bounds the work as well as the text (a huge
  nested value is never fully walked); integers past Python's int-to-str digit limit are described, not converted.
- `clip(text)`: text shown as it is (a path, a tensor name, another component's message) on one line, control
  characters escaped, the middle elided so that both ends of a long path stay readable.

A flat module of the package because the configuration (shipped as remote code) uses it as well as the converters.
"""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any

BRIEF_CHARS = 100


class _BoundedRepr(reprlib.Repr):
    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 3, 6, 6, 6, 6
        self.maxstring, self.maxother, self.maxlong = BRIEF_CHARS, BRIEF_CHARS, BRIEF_CHARS

    def repr_int(self, x: int, level: int) -> str:
        if abs(x).bit_length() > 1000:
            return f"<integer of about {int(abs(x).bit_length() * math.log10(2))} digits>"
        return super().repr_int(x, level)


_REPR = _BoundedRepr()


def brief(value: Any, limit: int = BRIEF_CHARS) -> str:
    """repr() of an untrusted value, at most `limit` characters."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip(text: Any, limit: int = BRIEF_CHARS) -> str:
    """str(text) on one line (control characters escaped), at most about `limit` characters, the middle elided."""
    text = re.sub(r"[\x00-\x1f\x7f]", lambda match: repr(match.group())[1:-1], str(text))
    if len(text) <= limit:
        return text
    head = (limit - 3) * 2 // 5
    return f"{text[:head]}...{text[-(limit - 3 - head):]}"


__all__ = ["BRIEF_CHARS", "brief", "clip"]
