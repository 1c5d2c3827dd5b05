# Shared by the scripts in slurm/ (sourced, not submitted). Reads Slurm's environment.
#   MINDDP_PYTHON   the Python with minddp installed (default: python3 on PATH)
#   MINDDP_RUN_DIR  the run directory (default: outputs/slurm-$SLURM_JOB_ID, one per job,
#                   kept across --requeue so train.resume=auto finds the checkpoint)
#   MINDDP_DRY_RUN=1  print the command the job would run (one line on stdout; notes on stderr)
#                   and exit 0, starting nothing: check a job before you queue it. Outside a job,
#                   what Slurm decides is printed as $SLURM_JOB_ID, $SLURM_ARRAY_JOB_ID,
#                   $SLURM_NNODES, $HEAD_ADDR (the first node's address) and $NODES.
PYTHON=${MINDDP_PYTHON:-python3}
# torchrun's arguments, through minddp.train.launch: a stop signal goes to the workers only, so the
# resume command is the log's last line and the exit code 0 (SIGTERM), not torchrun's traceback and 1
TORCHRUN=("$PYTHON" -m minddp.train.launch)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# torch 2.13's c10d rendezvous shares one TCPStore across restart rounds, so workers restarted
# by --max-restarts read the dead round's addresses (pytorch#135712); a store per round fixes it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
DRY_RUN=${MINDDP_DRY_RUN:-0}
# what a dry run outside a job prints in place of what Slurm decides (see `show`)
PLACEHOLDERS=(SLURM_JOB_ID SLURM_ARRAY_JOB_ID SLURM_NNODES HEAD_ADDR NODES)

# slurm_job: stop in one line (exit 2) outside a Slurm job, instead of bash's "unbound variable";
# a dry run there goes on with placeholders. Then RDZV_PORT, derived from the job id: concurrent
# jobs sharing a head node do not collide.
slurm_job() {
    if [ -n "${SLURM_JOB_ID:-}" ]; then
        RDZV_PORT=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
        return
    fi
    if [ "$DRY_RUN" != 1 ]; then
        echo "minddp: $0 is a Slurm batch script and SLURM_JOB_ID is not set: submit it with" \
             "sbatch $0 (MINDDP_DRY_RUN=1 $0 prints the command it would run)" >&2
        exit 2
    fi
    local p
    for p in "${PLACEHOLDERS[@]}"; do printf -v "$p" %s "${!p:-@$p@}"; done
    RDZV_PORT=${RDZV_PORT:-@RDZV_PORT@}
    echo "minddp: dry run outside a Slurm job: \$SLURM_* are what the job will set, \$HEAD_ADDR the" \
         "first node's address, \$NODES the nodes a task uses" >&2
}

# say MESSAGE: a line for the job's log (stderr in a dry run: stdout is the command alone)
say() {
    if [ "$DRY_RUN" = 1 ]; then unplaced "minddp: $*" >&2; else echo "minddp: $*"; fi
}

# unplaced TEXT: TEXT with each placeholder written as the variable the job sets
unplaced() {
    local text=$1 p
    text=${text//@RDZV_PORT@/\$((29500+SLURM_JOB_ID%1000))}
    for p in "${PLACEHOLDERS[@]}"; do text=${text//@$p@/\$$p}; done
    echo "$text"
}

# show CMD...: CMD as one shell line, after the environment the job exports
show() {
    local line="" word
    for word in MINDDP_RUN_DIR="$MINDDP_RUN_DIR" OMP_NUM_THREADS="$OMP_NUM_THREADS" \
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" "$@"; do
        if [[ $word =~ ^[][A-Za-z0-9_./:=,@%+-]+$ ]]; then
            line+=" $word"
        else
            line+=" '${word//\'/\'\\\'\'}'"
        fi
    done
    unplaced "${line# }"
}

# launch CMD...: run CMD as the job (run_with_requeue); with MINDDP_DRY_RUN=1 print it instead
launch() {
    if [ "$DRY_RUN" != 1 ]; then
        run_with_requeue "$@"
        return
    fi
    local has='import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ("torch", "hydra", "minddp"))))'
    if ! "$PYTHON" -c "$has" 2>/dev/null; then
        echo "minddp: warning: $PYTHON lacks torch, hydra or minddp here: set MINDDP_PYTHON to the" \
             "Python that has them (export MINDDP_PYTHON=\$PWD/.venv/bin/python)" >&2
    fi
    show "$@"
    exit 0
}

# head_addr: the address of the job's first node, as Slurm knows it.
head_addr() {
    [ "$SLURM_JOB_ID" = @SLURM_JOB_ID@ ] && { echo @HEAD_ADDR@; return; }  # a dry run outside a job
    local head addr
    job_nodes
    head=${JOB_NODES[0]}
    addr=$(scontrol show node "$head" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
    [ -n "$addr" ] || addr=$(getent hosts "$head" | awk 'NR == 1 {print $1}')
    case "$addr" in
        127.*|::1|localhost)
            # Loopback only works when every node of the job is this same host (a test
            # cluster); on a real cluster the other nodes would dial themselves.
            local hosts
            hosts=$(for n in "${JOB_NODES[@]}"; do
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

# first_nodes N: the job's first N node names, comma-separated
first_nodes() {
    [ "$SLURM_JOB_ID" = @SLURM_JOB_ID@ ] && { echo @NODES@; return; }  # a dry run outside a job
    job_nodes
    (IFS=,; echo "${JOB_NODES[*]:0:$1}")
}

# job_nodes: the job's node names into the array JOB_NODES. Read whole: under pipefail,
# `scontrol ... | head -n1` fails the job whenever head closes the pipe before scontrol has
# written its last line (SIGPIPE, exit 141).
job_nodes() {
    mapfile -t JOB_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    [ "${#JOB_NODES[@]}" -gt 0 ] || {
        echo "minddp: scontrol show hostnames '$SLURM_JOB_NODELIST' named no node" >&2; exit 1; }
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
