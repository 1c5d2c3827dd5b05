"""Collectives built from smaller ones, to see what the library does for you (ring, reduce-scatter
+ all-gather, tree, hierarchical) and the in-place pieces the engine and ZeRO-1 use
(`collectives`). The demos (`python -m minddp.demos`) teach from it.
"""
