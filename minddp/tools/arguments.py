"""How a tool declares and checks its arguments: one parser class and the value types.

    ap = tool_parser("scaling", __doc__)
    ap.add_argument("--worlds", type=int_list(), default="1,2,4")
    ap.add_argument("--calibration", type=readable(Calibration.load, "a calibration JSON"))

A value is checked where it is declared (argparse's `type=` and `choices=`), before the tool
imports a model or starts a process group, and a bad one is refused the same way everywhere:
one line on stderr, `minddp TOOL: error: --worlds 'x' is not a whole number`, and exit 2. A
check across options goes through the same path: `ap.error("...")`. Stdlib only, so the check
costs nothing beside argparse.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable


class BadValue(argparse.ArgumentTypeError):
    """A value these types refuse; its message reads after the option's name (`--n 0 is ...`)."""


class ToolParser(argparse.ArgumentParser):
    """argparse with minddp's one error path: every refusal (a type, a choice, a missing or an
    unknown option, a check across options) is one line and exit 2."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"exit_on_error": False, **kwargs})

    def parse_known_args(self, args=None, namespace=None):
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as e:  # exit_on_error=False: the error comes here, unprinted
            ours = isinstance(e.__context__, BadValue)  # raised by one of the types below
            self.error(f"{e.argument_name} {e.message}" if ours and e.argument_name else str(e))

    def error(self, message: str):
        rank = f"[rank {os.environ.get('RANK', '?')}] " if "LOCAL_RANK" in os.environ else ""  # torchrun
        message = " ".join(str(message).split())  # one line, whatever the message held
        _remove_made()  # a refused call leaves no empty output folder
        sys.stderr.write(f"{rank}{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")
        raise SystemExit(2)


def tool_parser(name: str, doc: str | None, formatter=argparse.RawDescriptionHelpFormatter) -> ToolParser:
    return ToolParser(prog=f"minddp {name}", description=doc, formatter_class=formatter)


# ------------------------------------------------------------------ numbers
def _bound(least: float, inclusive: bool) -> str:
    return f"{'>=' if inclusive else '>'} {least:g}"


def whole(least: int) -> Callable[[str], int]:
    """An integer >= least."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise BadValue(f"{text!r} is not a whole number") from None
        if value < least:
            raise BadValue(f"{value} is not possible: it must be a finite number {_bound(least, True)}")
        return value
    return parse


def number(least: float = 0.0, inclusive: bool = False) -> Callable[[str], float]:
    """A finite number above `least` (or equal, `inclusive`): NaN and inf never."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise BadValue(f"{text!r} is not a number") from None
        return _in_range(value, least, inclusive)
    return parse


def _in_range(value: float, least: float, inclusive: bool) -> float:
    if not (math.isfinite(value) and (value >= least if inclusive else value > least)):
        raise BadValue(f"{value:g} is not possible: it must be a finite number {_bound(least, inclusive)}")
    return value


positive_int = whole(1)
nonnegative_int = whole(0)
positive_float = number(0.0)
nonnegative_float = number(0.0, inclusive=True)

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "T": 1e12}


def parse_size(text: str) -> float:
    """'512MB' -> 5.12e8, '64MiB' -> 67108864, '124M' -> 1.24e8 (also for parameter counts)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    try:
        if m and m.group(2).upper() in _UNITS:
            return float(m.group(1)) * _UNITS[m.group(2).upper()]
    except ValueError:  # '1.2.3MB'
        pass
    raise BadValue(f"{text!r} is not a size (e.g. 512MB, 64MiB, 124M)")


def size(text: str) -> float:
    """A size (parse_size) greater than 0."""
    return _in_range(parse_size(text), 0.0, False)


# ------------------------------------------------------------------ lists
def int_list(least: int = 1) -> Callable[[str], list[int]]:
    """'1,2,4' -> [1, 2, 4]: at least one, each a whole number >= least."""
    return _list_of(whole(least), "whole numbers", "1,2,4")


def float_list(least: float = 0.0, inclusive: bool = False) -> Callable[[str], list[float]]:
    """'1,5,25' -> [1.0, 5.0, 25.0]: at least one, each finite and above `least`."""
    return _list_of(number(least, inclusive), "numbers", "1,5,25")


def choice_list(choices, every: str | None = None) -> Callable[[str], list[str]]:
    """'a,b' -> ['a', 'b'], each one of `choices`; `every` (e.g. 'all') -> all of them."""
    choices = list(choices)

    def one(text: str) -> str:
        if text not in choices:
            raise BadValue(f"{text!r} is not one of {', '.join(choices)}")
        return text

    parse = _list_of(one, "names", ",".join(choices[:2]))
    if every is None:
        return parse
    return lambda text: list(choices) if text == every else parse(text)


def _list_of(item: Callable, what: str, example: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or not all(parts):
            raise BadValue(f"{text!r} is not a comma-separated list of {what} (e.g. {example})")
        try:
            return [item(p) for p in parts]
        except BadValue as e:
            raise BadValue(f"{text!r}: {e}") from None
    return parse


# ------------------------------------------------------------------ files and folders
def readable(load: Callable, what: str, missing_ok: bool = False) -> Callable[[str], str]:
    """A file `load(path)` reads without an error (the path is returned; the tool loads it
    again where it needs it): a missing file (unless `missing_ok`: the tool has a fallback),
    one that is not JSON, one without the keys `load` needs are each one line naming `what`
    was expected."""
    def parse(text: str) -> str:
        path = Path(text)
        if missing_ok and not path.exists():
            return text
        if not path.is_file():
            raise BadValue(f"{text}: {'is a folder' if path.is_dir() else 'no such file'}; give {what}")
        try:
            load(text)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"{type(e).__name__}: {e}" if isinstance(e, (KeyError, TypeError)) else str(e)
            raise BadValue(f"{text} is not {what} ({why[:160]})") from None
        return text
    return parse


def _json(path: str):
    return json.loads(Path(path).read_text())


def _calibration(path: str):
    from ..perf.costmodel import Calibration  # only when one is given

    return Calibration.load(path)


json_file = readable(_json, "a JSON file")
CALIBRATION = "a calibration JSON (`make calibrate` writes one)"
calibration_file = readable(_calibration, CALIBRATION)


def existing_dir(text: str) -> str:
    if not Path(text).exists():
        raise BadValue(f"{text} does not exist")
    if not Path(text).is_dir():
        raise BadValue(f"{text} is a file, not a folder")
    return text


_made: list[Path] = []  # the folders writable_out_dir made in this process


def _remove_made() -> None:
    """The folders this call made, deepest first, where still empty (ToolParser.error)."""
    for folder in sorted(_made, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:  # something was written there meanwhile, or it is gone
            pass
    _made.clear()


def writable_out_dir(text: str) -> str:
    """A folder the tool writes into: made if missing (with its parents), and writable. A call
    refused later (ToolParser.error) removes what was made here."""
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise BadValue(f"{text} is a file: give a folder (or a name inside one)")
    try:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        _made.extend(p.absolute() for p in missing)
        with tempfile.TemporaryFile(dir=folder):  # what writing there needs, tried (root writes anywhere)
            pass
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != text else ""
        raise BadValue(f"{text} cannot be written: {e.strerror or e}{where}") from None
    return text


def writable_out(text: str) -> str:
    """An output file or file prefix (`--out docs/report` -> docs/report.md, .png): its folder is
    made if missing and must be writable; a name that ends in '/' names no file."""
    if not text or text.endswith(("/", os.sep)):
        raise BadValue(f"{text!r} names a folder: give a file name or prefix inside it "
                       f"(e.g. {text.rstrip('/')}/report)")
    writable_out_dir(str(Path(text).parent))
    return text
