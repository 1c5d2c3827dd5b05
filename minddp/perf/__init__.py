"""Performance: what communication and memory cost, predicted and measured. One of each.

    costmodel    alpha-beta formulas, fabric presets, `Calibration`, a DDP step's predicted busy
                 and exposed communication, bucket advice; buckets from minddp.engine.buckets' own plan
    memory       memory per rank (the one model), the bench-memory configurations, optimizer-state
                 bytes, `PeakMeter` and one rank's peak run
    sweep        the nccl-tests-style collective sweep (every result checked) and the alpha-beta fit
    calibration  what calibrate measures (contention, completion floor, the engine under backward)
                 and fits (per-op alpha-beta, the under-backward grid), repeats combined
    engine_cost  the engine's CPU cost per bucket, communication stubbed out
    engine_bench minddp against torch DDP: step time per bucket cap, the optimizer setups' phases
    clock        the one clock: CUDA events on GPU, the host clock on CPU; warm-up and rotated rounds
    workload     the loss every measurement runs (the models come from the caller)

perf reads the engine (its bucket plan, the wrapper itself) and the optimizers; it never
imports minddp.train or minddp.tools (tests/test_suite_rules.py). The command lines over it
are minddp/tools (`minddp costmodel`, `bench`, `calibrate`, `bench-ddp`, `bench-memory`).
"""
