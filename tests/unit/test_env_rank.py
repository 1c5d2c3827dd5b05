"""The rank an error message names: one rule (minddp.parallel.dist.env_rank over env_ranks), for
train.py, the run-dir check and the tools, also where the launch environment is incomplete."""

from minddp.parallel.dist import env_rank


def test_env_rank_follows_env_ranks_and_never_raises():
    assert env_rank({}) == "0"
    assert env_rank({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == "3"
    srun = {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
    assert env_rank(srun) == "2"
    assert env_rank({"RANK": "5"}) == "5"  # incomplete: env_ranks raises, the message still names the rank
    assert env_rank({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}) == "x"  # malformed, as set
    assert env_rank({"SLURM_PROCID": "1"}) == "0"  # not an srun step (a batch shell): env_ranks' rule
