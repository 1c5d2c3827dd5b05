"""matplotlib without a display, set up in one place (the tools' figures, the trainer's step trace)."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend: no display needed, on a node or in a test."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
