"""The run directory:

    lock.py         one live job per run directory: an OS lock rank 0 holds for the run's life
    run_dir.py      where a run writes, decided in one place; checked before Hydra makes it;
                    `.hydra/` written once the run is accepted

Atomic writes and pickles read without running code are minddp/io/'s.
"""
