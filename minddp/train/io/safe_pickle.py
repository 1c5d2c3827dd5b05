"""Read a pickle from someone else's machine without running its code.

A pickle can name any importable callable and call it on load. Files minddp reads
that are pickles by convention (nanoGPT's `meta.pkl`, torch's flight-recorder dumps)
hold only plain containers, strings and numbers, so an unpickler that refuses every
class or function loses nothing and cannot execute anything.
"""

from __future__ import annotations

import io
import pickle


class UnsafePickleError(ValueError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise UnsafePickleError(
            f"refused to load {module}.{name}: only plain containers, strings and numbers are allowed "
            "(a pickle that names a class or function can run code when loaded)")


def loads(data: bytes):
    return _PlainUnpickler(io.BytesIO(data)).load()


def load(path):
    with open(path, "rb") as f:
        return _PlainUnpickler(f).load()
