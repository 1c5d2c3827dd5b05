"""Read a pickle from someone else's machine without running its code.

A pickle can name any importable callable and call it on load. Files minddp reads
that are pickles by convention (nanoGPT's `meta.pkl`, torch's flight-recorder dumps)
hold only plain containers, strings and numbers, so an unpickler that refuses every
class or function loses nothing and cannot execute anything. A format made of a few
known classes (DCP's `.metadata`, checkpoint/dcp_reader.py) passes their names as
`allowed`, {(module, name)}: those are resolved as pickle would, any other is refused
(the "restricting globals" recipe of Python's pickle documentation).
"""

from __future__ import annotations

import io
import pickle


class UnsafePickleError(ValueError):
    pass


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, f, allowed=frozenset()):
        super().__init__(f)
        self.allowed = allowed  # {(module, name)}

    def find_class(self, module, name):
        if (module, name) in self.allowed:
            return super().find_class(module, name)
        what = "the classes this format is made of" if self.allowed else "plain containers, strings, numbers"
        raise UnsafePickleError(
            f"refused to load {module}.{name}: only {what} are allowed "
            "(a pickle that names a class or function can run code when loaded)")


def loads(data: bytes, allowed=frozenset()):
    return _RestrictedUnpickler(io.BytesIO(data), allowed).load()


def load(path, allowed=frozenset()):
    with open(path, "rb") as f:
        return _RestrictedUnpickler(f, allowed).load()
