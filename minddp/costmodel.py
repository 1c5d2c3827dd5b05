"""Deprecated path: the cost model moved to `minddp.perf.costmodel` (its command line is
minddp/tools/costmodel.py). `from minddp import costmodel` keeps working for one release."""

from .perf.costmodel import *  # noqa: F401,F403
from .perf.memory import memory_per_rank  # noqa: F401

_MOVED_TO_TOOLS = {"parse_size", "explain_all_reduce", "explain_hierarchical", "explain_tree",
                   "explain_zero", "inter_node_bytes"}


def __getattr__(name):
    # the old CLI section's helpers live with the command line now (imported on use: the
    # package root does not import tools)
    if name in _MOVED_TO_TOOLS:
        from .tools import costmodel as cli

        return getattr(cli, name)
    raise AttributeError(f"module 'minddp.costmodel' has no attribute {name!r}")
