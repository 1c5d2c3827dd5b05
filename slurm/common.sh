# Shared by the sbatch scripts (sourced, not submitted). Reads Slurm's environment.
#   MINDDP_PYTHON   the Python with minddp installed (default: python3 on PATH)
#   MINDDP_RUN_DIR  the run directory (default: outputs/slurm-$SLURM_JOB_ID, one per job,
#                   kept across --requeue so train.resume=auto finds the checkpoint)
PYTHON=${MINDDP_PYTHON:-python3}
# torchrun's arguments, through minddp.train.launch: a stop signal goes to the workers only, so the
# resume command is the log's last line and the exit code 0 (SIGTERM), not torchrun's traceback and 1
TORCHRUN=("$PYTHON" -m minddp.train.launch)
export MINDDP_RUN_DIR=${MINDDP_RUN_DIR:-outputs/slurm-${SLURM_JOB_ID}}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# torch 2.13's c10d rendezvous shares one TCPStore across restart rounds, so workers restarted
# by --max-restarts read the dead round's addresses (pytorch#135712); a store per round fixes it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# A port derived from the job id: concurrent jobs sharing a head node do not collide.
RDZV_PORT=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}

# head_addr: the address of the job's first node, as Slurm knows it.
head_addr() {
    local head addr
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    addr=$(scontrol show node "$head" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
    [ -n "$addr" ] || addr=$(getent hosts "$head" | awk '{print $1; exit}')
    case "$addr" in
        127.*|::1|localhost)
            # Loopback only works when every node of the job is this same host (a test
            # cluster); on a real cluster the other nodes would dial themselves.
            local hosts
            hosts=$(for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
                        scontrol show node "$n" | sed -n 's/.*NodeHostName=\([^ ]*\).*/\1/p'
                    done | sort -u | wc -l)
            if [ "$hosts" -gt 1 ]; then
                echo "minddp: head node $head resolves to the loopback address $addr; set" \
                     "NodeAddr in slurm.conf or fix /etc/hosts so the nodes can reach it" >&2
                exit 1
            fi ;;
    esac
    echo "$addr"
}

# run_with_requeue CMD...: run CMD in the background; on SIGUSR1 (sent by
# --signal=B:USR1@90 before the time limit) pass SIGTERM on, so the trainer writes a
# checkpoint and exits, then requeue the job: it resumes with train.resume=auto.
run_with_requeue() {
    "$@" &
    local child=$!
    # (`|| true`: under srun a signal that reaches torchrun itself still makes it exit non-zero)
    trap 'echo "minddp: time limit near, checkpointing and requeueing"; kill -TERM '"$child"'; wait '"$child"' || true; scontrol requeue "$SLURM_JOB_ID"; exit 0' USR1
    trap 'kill -TERM '"$child"'; wait '"$child"' || true; exit 143' TERM
    wait "$child"
}
