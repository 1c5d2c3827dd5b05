"""What a run reports about itself:

    tracking.py         metrics.jsonl (one row per log step), W&B, the progress bar, the closing lines
    wandb_run.py        W&B that never takes a run down: auto mode, a run that cannot start, resume
    summary.py          the steady-state summary of a run's rows (also `minddp report`'s)
    identity.py         what a run is (layout, engine, device, commit) and its name
    flops.py            FLOPs per token, the device peak, TFLOP/s and MFU
    probe.py            the step's instrumentation at named points (the flight recorder's context,
                        trace, arrival clock, faults, memory)
    straggler.py        the slowest rank, from the probe's arrival clock
    steptrace.py        one step traced (bucket events, phases) to a Chrome trace and a figure
    flight_recorder.py  torch's flight recorder: configured, given the step, dumped on a failure
"""
