"""Reading files a checkpoint brings along (metadata.yaml, config.json, index files, safetensors headers) as untrusted
input.

A checkpoint may come from anywhere (a download, a colleague's disk), so its text files are read with bounds that a
real file never reaches and a hostile one always does: a size cap before reading, a nesting-depth cap checked on the
token or event stream before any object is built (deep nesting would otherwise end in a RecursionError), a cap on the
number of YAML nodes after alias expansion ("billion laughs": the loader itself shares aliased objects, but every
consumer that walks them would pay for the expansion), no duplicate JSON keys (which value wins is ambiguous), and
no NaN or infinity in JSON, written as such or as transformers writes them ({"__float__": "NaN"}): Python's parser
accepts them, and a writer would carry them on. Only regular files are read (`source_files`).

Values are then read through `Fields`, one typed getter per kind of value, so that a wrong type gives one line naming
the file, the dotted key, what the value should be and what it is. `brief` is the only way a user-supplied value
reaches an error message: at most ~100 characters, whatever its size.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from ..shown_values import BRIEF_CHARS, brief, clip  # noqa: F401  (re-exported for the readers)
from .errors import ConversionError
from .source_files import open_source_file

MAX_TEXT_BYTES = 64 * 2**20  # metadata.yaml / config.json / index files: real ones are kilobytes
MAX_DEPTH = 64  # real files nest at most ~10 levels
MAX_YAML_NODES = 1_000_000  # after alias expansion; a real metadata.yaml has a few thousand
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ------------------------------------------------------------------------------------------------ showing values


_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "a list"),
          (Mapping, "a mapping"), (type(None), "null"))


def describe(value: Any) -> str:
    """`a string 'abc'`: the value's kind in YAML/JSON words, and the value itself, briefly."""
    kind = next((name for cls, name in _KINDS if isinstance(value, cls)), type(value).__name__)
    return kind if value is None else f"{kind} {brief(value)}"


# ------------------------------------------------------------------------------------------------ parsing


def read_text(path: Path, kind: str = "metadata", max_bytes: int | None = None) -> str:
    """The text of a small file (`kind`: what it is, for the message), refusing one of more than `max_bytes` (default
    MAX_TEXT_BYTES), too large to be that, and anything but a regular file (`source_files`)."""
    max_bytes = MAX_TEXT_BYTES if max_bytes is None else max_bytes
    try:
        with open_source_file(path) as file:
            size = os.fstat(file.fileno()).st_size
            data = file.read(size + 1) if size <= max_bytes else b""  # + 1: a file growing while read shows
            if size > max_bytes or len(data) > max_bytes:
                raise ConversionError(f"{path} has {max(size, len(data))} bytes, more than the {max_bytes} a {kind} "
                                      "file can reasonably have; it is not the file this reader expects.")
            return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConversionError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); the file is "
                              "corrupt.") from None
    except OSError as error:
        raise ConversionError(f"cannot read {path}: {brief(str(error), 300)}") from error


def _too_deep(label: str) -> ConversionError:
    return ConversionError(f"{label} nests deeper than {MAX_DEPTH} levels; no checkpoint file does, so it is corrupt "
                           "or hostile. Restore it from the original checkpoint.")


# A JSON string (an unterminated one runs to the end, so a scan never restarts inside it), or a run of characters
# that are neither quotes nor brackets: what remains after removing both is the bracket sequence.
_JSON_STRING_OR_FILLER = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\Z)|[^"\[\]{}]++', re.DOTALL)
_DEPTH_STEP = torch.zeros(256, dtype=torch.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


def json_depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text, from its token stream (vectorised: a hostile 100 MB header holds
    tens of millions of brackets); for a text with few brackets, their count (an upper bound) is enough."""
    openers = text.count("[") + text.count("{")
    if openers <= MAX_DEPTH:
        return openers  # cannot nest deeper than it has brackets
    brackets = _JSON_STRING_OR_FILLER.sub("", text).encode("ascii")
    if not brackets:
        return 0
    steps = _DEPTH_STEP[torch.frombuffer(bytearray(brackets), dtype=torch.uint8).long()]
    return int(torch.cumsum(steps, 0, dtype=torch.int64).max())


# transformers' config files write a non-finite float as {"__float__": "NaN"} and read it back as one
_FLOAT_TAG = "__float__"
_NON_FINITE_TAGS = ("NaN", "Infinity", "-Infinity")


class _Hooks:
    """json.loads' hooks for an untrusted file: objects refuse a key given twice, and every NaN or infinity (a
    literal, a number beyond a float's range, transformers' tag) is noted, so that only a file holding one is walked
    to name where (`_non_finite`)."""

    def __init__(self, label: str):
        self.label, self.non_finite = label, False

    def object(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):
            seen: set[str] = set()
            duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
            raise ConversionError(f"{self.label}: key {brief(duplicate)} appears twice in one object, so which "
                                  "value holds is ambiguous; the file is corrupt.")
        if len(pairs) == 1 and pairs[0][0] == _FLOAT_TAG:
            self.non_finite = self.non_finite or pairs[0][1] in _NON_FINITE_TAGS
        return result

    def constant(self, name: str) -> float:  # NaN, Infinity, -Infinity
        self.non_finite = True
        return float(name)

    def number(self, text: str) -> float:
        value = float(text)
        self.non_finite = self.non_finite or not math.isfinite(value)
        return value


def _non_finite(document: Any) -> tuple[str, str] | None:
    """The first NaN or infinity in a parsed JSON document (Python's parser reads `NaN` and `Infinity`, and rounds
    `1e999` to infinity), also as transformers writes one: (where, what), or None."""
    pending = [("", document)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "the top level", repr(value)
        if isinstance(value, dict):
            if len(value) == 1 and value.get(_FLOAT_TAG) in _NON_FINITE_TAGS:
                return where or "the top level", f"{brief(value)} (transformers' writing of {value[_FLOAT_TAG]})"
            pending += [(f"{where}.{clip(str(key), 60)}" if where else clip(str(key), 60), item)
                        for key, item in reversed(value.items())]
        elif isinstance(value, list):
            pending += [(f"{where}[{index}]", item) for index, item in reversed(list(enumerate(value)))]
    return None


def parse_json(text: str, label: str) -> Any:
    """JSON from an untrusted file; any problem is a ConversionError naming `label`."""
    if json_depth(text) > MAX_DEPTH:
        raise _too_deep(label)
    hooks = _Hooks(label)
    try:
        document = json.loads(text, object_pairs_hook=hooks.object, parse_constant=hooks.constant,
                              parse_float=hooks.number)
    except json.JSONDecodeError as error:
        raise ConversionError(f"{label} is not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); "
                              "the file is corrupt.") from None
    except ValueError as error:  # e.g. an integer beyond Python's 4300-digit limit
        raise ConversionError(f"{label} is not valid JSON ({brief(str(error))}); the file is corrupt.") from None
    found = _non_finite(document) if hooks.non_finite else None
    if found is not None:
        raise ConversionError(f"{label}: {found[0]} is {found[1]}; JSON has no NaN or infinity (a number beyond a "
                              "float's range, like 1e999, reads as infinite) and no checkpoint value is either, so "
                              "the file is corrupt.")
    return document


def _check_yaml_events(text: str, label: str) -> None:
    """Walks the event stream (no objects built) and tracks, per open collection, its node count and height with
    aliases counted at the size of what they point to: deep nesting and alias bombs are refused before the loader,
    whose composer recurses per level, ever sees them."""
    frames = [[0, 0, None]]  # per open collection: [nodes inside, height, anchor]
    anchors: dict[str, tuple[int, int]] = {}
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            frames.append([1, 0, event.anchor])
            if len(frames) - 1 > MAX_DEPTH:
                raise _too_deep(label)
            continue
        if isinstance(event, yaml.AliasEvent):
            nodes, height = anchors.get(event.anchor, (1, 0))  # an undefined alias: the loader reports it
        elif isinstance(event, yaml.ScalarEvent):
            nodes, height = 1, 0
            if event.anchor is not None:
                anchors[event.anchor] = (1, 0)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            nodes, height, anchor = frames.pop()
            height += 1
            if anchor is not None:
                anchors[anchor] = (nodes, height)
        else:
            continue
        frame = frames[-1]
        frame[0] += nodes
        frame[1] = max(frame[1], height)
        if len(frames) - 1 + height > MAX_DEPTH:
            raise _too_deep(label)
        if frame[0] > MAX_YAML_NODES:
            raise ConversionError(f"{label} expands to more than {MAX_YAML_NODES} YAML nodes through its aliases "
                                  "(*name references to &name anchors); a Fast-LLM metadata file has a few thousand, "
                                  "so it is corrupt or hostile. Restore it from the original checkpoint.")


def parse_yaml(text: str, label: str) -> Any:
    """YAML (safe subset) from an untrusted file; any problem is a ConversionError naming `label`."""
    try:
        _check_yaml_events(text, label)
        return yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as error:
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConversionError(f"{label} is not readable YAML ({brief(detail, 200)}); the file is corrupt, restore it "
                              "from the original checkpoint.") from None
    except (ValueError, OverflowError) as error:  # a scalar the safe constructor cannot build (a huge int, a date)
        raise ConversionError(f"{label} is not readable YAML ({brief(str(error))}); the file is corrupt, restore it "
                              "from the original checkpoint.") from None


# ------------------------------------------------------------------------------------------------ typed access

REQUIRED = object()


def matches(value: Any, option: Any) -> bool:
    """`value == option` with types respected: True is not 1, "false" is not False, 1 may stand for 1.0."""
    if option is None or isinstance(option, bool):
        return value is option
    if isinstance(option, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == option
    return type(value) is type(option) and value == option


class Fields:
    """A mapping from an untrusted file, read key by key through typed getters. Each getter checks the value's type
    (bool is never a number; a float is never an integer, not even 2.0, since the writers of these files write
    integers as integers) and its range, and raises one ConversionError line naming the file, the dotted key, what the
    value should be and what it is. `finish()` refuses the keys nobody read."""

    def __init__(self, data: Any, path: str, file: str, missing_is_empty: bool = True):
        if data is None and missing_is_empty:
            data = {}
        if not isinstance(data, Mapping):
            where = f"{path} should be a mapping" if path else "its top level should be a mapping"
            raise ConversionError(f"{file}: {where}, got {describe(data)}.")
        self.data, self.path, self.file, self._used = data, path, file, set()

    def where(self, key: Any) -> str:
        name = clip(key, BRIEF_CHARS) if isinstance(key, str) else brief(key)
        return f"{self.path}.{name}" if self.path else name

    def wrong(self, key: Any, expected: str, value: Any, hint: str = "") -> ConversionError:
        return ConversionError(f"{self.file}: {self.where(key)} should be {expected}, got {describe(value)}{hint}.")

    def missing(self, key: str, hint: str = "") -> ConversionError:
        return ConversionError(f"{self.file} does not give {self.where(key)}{hint}.")

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value (for values checked by their consumer); prefer a typed getter."""
        self._used.add(key)
        return self.data.get(key, default)

    def _value(self, key: str, default: Any, hint: str = "") -> Any:
        self._used.add(key)
        if key in self.data:
            return self.data[key]
        if default is REQUIRED:
            raise self.missing(key, hint)
        return default

    def integer(self, key: str, default: Any = REQUIRED, *, minimum: int | None = None,
                maximum: int | None = None, too_large: str = "", hint: str = "") -> Any:
        """An int (not a bool, not a float) within [minimum, maximum]; `too_large` explains the maximum."""
        value = self._value(key, default, hint)
        if value is None and default is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            expected = "an integer" + (f" >= {minimum}" if minimum is not None else "")
            raise self.wrong(key, expected, value)
        if minimum is not None and value < minimum:
            raise self.wrong(key, f"an integer >= {minimum}", value)
        if maximum is not None and value > maximum:
            raise ConversionError(f"{self.file}: {self.where(key)} is {brief(value)}, more than {too_large or maximum}"
                                  "; the config does not match the weights, fix the config.")
        return value

    def number(self, key: str, default: Any = REQUIRED, *, positive: bool = False) -> Any:
        """A finite int or float (not a bool); `positive` also excludes zero and negatives."""
        value = self._value(key, default)
        if value is None and default is None:
            return None
        expected = "a positive number" if positive else "a finite number"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            hint = ""
            if isinstance(value, str) and _looks_like_a_float(value):
                hint = " (YAML 1.1 reads an exponent without a decimal point, like 1e-5, as a string: write 1.0e-05)"
            raise self.wrong(key, expected, value, hint)
        if not math.isfinite(value) or (positive and value <= 0):
            raise self.wrong(key, expected, value)
        return value

    def boolean(self, key: str, default: Any = REQUIRED, hint: str = "") -> Any:
        """true or false (not "false", not 0)."""
        value = self._value(key, default, hint)
        if value is None and default is None:
            return None
        if not isinstance(value, bool):
            raise self.wrong(key, "true or false", value)
        return value

    def string(self, key: str, default: Any = REQUIRED) -> Any:
        value = self._value(key, default)
        if value is None and default is None:
            return None
        if not isinstance(value, str):
            raise self.wrong(key, "a string", value)
        return value

    def name(self, key: str, choices: Iterable[str], default: Any = REQUIRED) -> Any:
        """One of `choices`."""
        choices = tuple(choices)
        value = self.string(key, default)
        if value is None and default is None:
            return None
        if value not in choices:
            raise self.wrong(key, "one of " + ", ".join(repr(c) for c in choices), value)
        return value

    def sequence(self, key: str, default: Any = REQUIRED, *, item: type | None = None,
                 non_empty: bool = False) -> Any:
        """A list, each entry of type `item` if given (bools are never ints)."""
        value = self._value(key, default)
        if value is None and default is None:
            return None
        what = "a non-empty list" if non_empty else "a list"
        what += f" of {_PLURAL.get(item, 'values')}" if item else ""
        if not isinstance(value, list) or (non_empty and not value):
            raise self.wrong(key, what, value)
        if item is not None:
            for index, entry in enumerate(value):
                if not isinstance(entry, item) or (item is int and isinstance(entry, bool)):
                    raise self.wrong(f"{key}[{index}]", _SINGULAR.get(item, item.__name__), entry)
        return value

    def _child(self, data: Any, path: str) -> Fields:
        return Fields(data, path, self.file)

    def mapping(self, key: str) -> Fields:
        """The sub-mapping at `key` (missing or null: empty), read with the same typed getters."""
        return self._child(self.get(key), self.where(key))

    sub = mapping

    def expect(self, key: str, allowed: tuple, default: Any, meaning: str) -> Any:
        """A value our model supports only in the forms `allowed` (the first is the one to use)."""
        value = self.get(key, default)
        if not any(matches(value, option) for option in allowed):
            raise ConversionError(f"{self.file}: {self.where(key)} = {brief(value)} is not supported ({meaning}); "
                                  f"HybridLinearConfig can only express {allowed[0]!r}.")
        return value

    def unread(self, ignorable: Iterable[str] = ()) -> list[str]:
        ignorable = set(ignorable)
        return sorted((self.where(k) for k in self.data if k not in self._used and k not in ignorable), key=str)


_PLURAL = {int: "integers", str: "strings", float: "numbers", bool: "booleans", list: "lists", dict: "mappings"}
_SINGULAR = {int: "an integer", str: "a string", float: "a number", bool: "a boolean", list: "a list",
             dict: "a mapping"}


def _looks_like_a_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def plain_file_name(value: Any, where: str) -> str:
    """A file name inside the checkpoint folder: no path separators, no '..', nothing absolute, at most 255
    characters (no file system allows more)."""
    if (not isinstance(value, str) or not value or len(value) > 255 or value in (".", "..") or "/" in value
            or "\\" in value or "\0" in value or Path(value).name != value):
        raise ConversionError(f"{where} should be a plain file name inside the checkpoint folder, got "
                              f"{describe(value)}; an index may not point outside its folder.")
    return value


__all__ = [
    "MAX_DEPTH",
    "MAX_TEXT_BYTES",
    "MAX_YAML_NODES",
    "REQUIRED",
    "Fields",
    "brief",
    "clip",
    "describe",
    "json_depth",
    "matches",
    "parse_json",
    "parse_yaml",
    "plain_file_name",
    "read_text",
]
