"""Performance: what communication and memory cost, predicted and measured. One of each.

    costmodel    alpha-beta formulas, fabric presets, `Calibration`, a DDP step's predicted busy
                 and exposed communication, bucket advice; buckets from minddp.buckets' own plan
    memory       memory per rank (the one model), optimizer-state bytes, `PeakMeter`
    sweep        the nccl-tests-style collective sweep (every result checked) and the alpha-beta fit
    calibration  calibrate's fits: per-op alpha-beta, the under-backward grid fit, repeats combined
    engine_cost  the engine's CPU cost per bucket, communication stubbed out
    clock        the one clock: CUDA events on GPU, the host clock on CPU; warm-up and rotated rounds

perf reads the engine (its bucket plan, the wrapper itself); it never imports minddp.train or
minddp.tools. The command lines over it are minddp/tools (`minddp costmodel`, `bench`, `calibrate`).
"""
