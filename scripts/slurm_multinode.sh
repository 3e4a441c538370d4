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
#SBATCH --job-name=bookgpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-.}"
source .venv/bin/activate

export CONFIG=${CONFIG:-accelerate_configs/2x8xh100.yaml}
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MAIN_PROCESS_IP=${NODES[0]}
export MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-29500}
export NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))

# One task per node; SLURM_NODEID differs per task, so it is read inside the task (single quotes).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '
  accelerate launch -q --config_file "$CONFIG" \
    --num_machines "$SLURM_NNODES" --num_processes "$NUM_PROCESSES" --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MAIN_PROCESS_IP" --main_process_port "$MAIN_PROCESS_PORT" \
    train_accel.py "$@"
' bash "$@"
