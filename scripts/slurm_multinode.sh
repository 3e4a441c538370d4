#!/bin/bash
# Multi-node training under SLURM: one `accelerate launch` per node, which starts one process per GPU there.
#
#   sbatch scripts/slurm_multinode.sh --preset gpt2-774m --micro-batch-size 8     # args go to train_accel.py
#   CONFIG=accelerate_configs/8xh100_fsdp.yaml sbatch --nodes 4 scripts/slurm_multinode.sh \
#       --preset gpt2-1558m --micro-batch-size 4 --out-dir /shared/runs/1558m
#
# micro_batch_size × 1,024 × GPUs must divide total_batch_tokens (131,072 by default): 8 on 16 GPUs, 4 on 32.
# CONFIG picks the engine (DDP, FSDP2, ZeRO); whatever its num_machines / machine_rank / main_process_ip say,
# the scheduler's values replace them: num_processes = nodes × GPUS_PER_NODE (the total), machine_rank = the
# node's index in the job, main_process_ip = the job's first node. --out-dir (checkpoints are written by
# every rank) and --data-dir must be on storage all nodes share.
#
# Never lose the job: a run continues from its newest intact checkpoint in --out-dir when launched again (--resume
# auto is the default), so a requeued job, which runs this script again with the same arguments, continues it.
# - Preempted (or a node failed): --requeue puts the job back in the queue. SLURM sends SIGTERM to every process
#   of the step, the runs finish their step and save, and after the partition's GraceTime SIGKILL: that grace must
#   exceed the one the run prints at its first checkpoint ("set your grace period above N s"); see `scontrol show
#   partition`. The runs end before the grace does, so this script requeues the job itself (SLURM would not).
# - The time limit: 5 minutes before it SLURM sends USR1 to this script, which stops the run the same way and
#   requeues the job (for more lead, when a step plus a save takes longer: sbatch --signal=B:USR1@600 ...).
# torchrun gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds after a SIGTERM before it kills them: set here
# to 270 s, under the 300 s warning (torch >= 2.12; torch 2.11's torchrun waits a fixed 30 s).
#SBATCH --job-name=bookgpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300

set -euo pipefail

if [[ -z ${SLURM_JOB_ID:-} ]]; then  # run by hand: the machines, the rank and the requeue all come from the job
  echo "error: this is a SLURM batch script: submit it with \`sbatch scripts/slurm_multinode.sh ARGS\` (on one" \
    "machine without SLURM, run \`accelerate launch ... train_accel.py ARGS\` instead)" >&2
  exit 1
fi
# The job starts where sbatch was run (or in its --chdir): the repository's root, which holds .venv.
if [[ ! -f .venv/bin/activate ]]; then
  echo "error: no .venv/bin/activate in $PWD: submit the job from the repository's root (or sbatch --chdir ROOT)," \
    "after \`make install\` made .venv there" >&2
  exit 1
fi
# shellcheck source=/dev/null
source .venv/bin/activate

export CONFIG=${CONFIG:-accelerate_configs/2x8xh100.yaml}
# One process per GPU: SLURM says how many this node has; a job without GPUs (on CPUs) must say how many processes.
if [[ -z ${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}} ]]; then
  echo "error: job $SLURM_JOB_ID has no GPUs, so the processes per node are unknown: set GPUS_PER_NODE, e.g." \
    "CONFIG=accelerate_configs/cpu_ddp2.yaml GPUS_PER_NODE=2 sbatch --gpus-per-node=0 --cpus-per-task=CORES ..." >&2
  exit 1
fi
export GPUS_PER_NODE=${GPUS_PER_NODE:-$SLURM_GPUS_ON_NODE}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MAIN_PROCESS_IP=${NODES[0]}
export MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-29500}
export NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-270}

# The time-limit warning (USR1): SIGTERM to the job's step (scancel signals the steps' processes, not this batch
# shell), so each node's launcher and every run process get it; once the checkpoint is saved and srun has ended,
# requeue this job. Not `kill -TERM` to srun: srun answers a SIGTERM of its own by SIGKILLing its tasks.
requeue() {
  echo "job $SLURM_JOB_ID nears its time limit: stopping the run (it saves a checkpoint), then requeueing"
  scancel --signal=TERM "$SLURM_JOB_ID" || true
  wait "$SRUN_PID" || true
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}
trap requeue USR1

# One task per node; SLURM_NODEID differs per task, so it is read inside the task (single quotes). training.launch
# is `accelerate launch` whose log ends with the run's own error line, not torchrun's traceback.
# The CPUs asked of sbatch, given to the step: srun does not take them from the job in SLURM 22.05 to 23.02.
CPUS=()
[[ -n ${SLURM_CPUS_PER_TASK:-} ]] && CPUS=(--cpus-per-task "$SLURM_CPUS_PER_TASK")
# Each machine's run prints its own log, and the job's one output file holds them all: on several nodes each line says
# which node's it is ("1: step 120/4769 ...").
LABEL=()
((SLURM_NNODES > 1)) && LABEL=(--label)
# shellcheck disable=SC2016
srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${LABEL[@]}" "${CPUS[@]}" bash -c '
  python -m training.launch -q --config_file "$CONFIG" \
    --num_machines "$SLURM_NNODES" --num_processes "$NUM_PROCESSES" --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MAIN_PROCESS_IP" --main_process_port "$MAIN_PROCESS_PORT" \
    train_accel.py "$@"
' bash "$@" &
SRUN_PID=$!
status=0
wait "$SRUN_PID" || status=$?  # in the background and waited for, so the USR1 trap runs at once, not after srun ends
# Preempted (PreemptMode=REQUEUE): SLURM sends SIGTERM to the step and, after the partition's GraceTime, requeues the
# job; but a job that ends within its grace, as one whose runs saved and stopped does, is not requeued (it ends
# FAILED with the step's status): requeue it here.
if ((status != 0)) && scontrol show job "$SLURM_JOB_ID" | grep -q 'PreemptTime=[0-9]'; then
  echo "job $SLURM_JOB_ID was preempted: the run saved a checkpoint; requeueing"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
