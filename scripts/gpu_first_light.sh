#!/usr/bin/env bash
# First light on one CUDA GPU: every GPU check in one go of <= 9 minutes on an H100, each figure and log
# written to OUT_DIR and packed at the end into OUT_DIR/first_light.tgz, without the run's weights. From a checkout
# with a prepared data/default, no network needed:
#
#   scripts/gpu_first_light.sh OUT_DIR [--dry-run] [--data-dir data/default] [--cache DIR] [--peer-dir DIR]
#                              [--wheels DIR] [--time-limit SECONDS]
#
# The steps below, in order (or those FIRST_LIGHT_STEPS names, e.g. "environment train recipe", in its order), each
# logged to OUT_DIR/NN-step.log and timed in OUT_DIR/summary.md, a failed step not stopping the next ones (the exit
# status is 1 if any failed); a step still running at --time-limit (540 s; none with --dry-run) is stopped, and the
# steps after it are skipped, so the pack is written inside a device call's limit:
#   environment  the machine, torch and the packages; every module the steps import
#   tests     the fused loss against fp64 (tests/modeling/test_fused_ce.py, on this machine's torch: torch 2.11 has
#             wrong-gradient bugs for compiled autograd.Functions, pytorch#180642/#184113), the FP8 head against the
#             bf16 head and fp64 (tests/modeling/test_fp8_head.py), the one-step-late verdict on CUDA, and
#             `python -m bench.loss_numerics --device cuda`
#   train     the README's `accelerate launch --config_file accelerate_configs/1xgpu.yaml train_accel.py`, shortened
#             to TRAIN_STEPS (200) steps, with --micro-batch-size auto: metrics.jsonl, samples, loss.png, a
#             checkpoint and the export; its "micro-batch: auto" and "start-up:" lines go into summary.md, and
#             any recompile or graph break dynamo logs (TORCH_LOGS=recompiles,graph_breaks)
#   recipe    python -m bench.time_to_loss: the default recipe (Muon + wsd) against AdamW + cosine on the same tokens
#             and seeds (RECIPE_SEEDS, 2): 100 steps of 64k tokens each (3.8 epochs of data/default), val loss
#             against tokens and seconds, and the tokens and seconds each takes to AdamW's final val loss
#   fp8       the train step's run for SHORT_STEPS (30) steps with --fp8-head true (no eval, checkpoint or export):
#             its tok/s against the train step's
#   ladder    python -m bench.ladder at gpt2-124m, rungs LADDER_RUNGS (0,2,5,7,9,11), build-nanogpt beside it
#             (--peer-dir: a folder holding its train_gpt2.py; skipped without one), --profile-steps 3
#   loss      python -m bench.loss_speed at gpt2-124m: the fused loss against F.cross_entropy (time, peak memory),
#             eager and compiled, and which form the loss rule (modeling.fused_ce.takes_full_logits) picks
#   nccl      the MULTI_GPU accelerate_configs/8xh100.yaml launched in 1 process: an all_reduce over the process
#             group, which must be NCCL, then 20 training steps (no eval, sample or export: the train step's)
#   hellaswag python -m evals on the train step's export, HELLASWAG_LIMIT (2000) examples
#   cpu       the unit tests that launch no process (tests/modeling, tests/training, -m "not slow") on this machine's
#             CPU, CPU_TEST_WORKERS (8) pytest workers, each test's result on its own line: GPU machines have had
#             Intel Xeons with AMX, which this project's CI VMs rarely are; the failures go into
#             summary.md with the CPU's name and ISA
#   cpu_speed the CPU training step on the box's CPU, pinned to two cores as a 2-core VM has them
#             (taskset -c 0,1, OMP_NUM_THREADS=2): python -m bench.ladder at small-cpu, rung 11 in bf16
#             (accelerate_configs/cpu_bf16.yaml): tok/s and MFU against the measured bf16 matmul peak; then
#             python -m bench.profile on the same step: its time by kind, each matmul's time within it by shape
#             (cpu_speed/profile.md), on the AMX Xeons GPU machines have had
#   gpus      accelerate_configs/8xh100.yaml (8 processes) on this machine's fewer GPUs: every rank must stop at
#             start-up with the one line that gives the --num_processes that fits (no GPU to count with --dry-run)
#   fsdp      accelerate_configs/8xh100_fsdp.yaml in one process (--num_processes 1) for FSDP_STEPS (30) steps, with
#             --micro-batch-size auto, an eval, a sharded checkpoint and the export gathered from the shards: FSDP2,
#             its per-block compile and the head's compiled loss, never yet run on a GPU; its start-up line and tok/s
#             go into summary.md (--dry-run: cpu_fsdp2.yaml in one process, dynamo's eager backend)
#
# --dry-run runs the same steps on the CPU at toy sizes (tiny-cpu, a few steps, gloo for NCCL, eager compile,
# loss_numerics left out): CI runs it (tests/e2e/test_first_light.py); without it, where torch finds no CUDA GPU,
# the script stops at once with one line saying why, before it writes anything. --cache sets BOOKGPT_CACHE (the
# tokenizer and eval data, see data_prep.assets); --wheels installs the *.whl there into a temporary folder first (the
# GPU box has no network). BENCHMARKS.md, "GPU", has the payload recipe and the device command.
#
# What the next lent GPU runs, within one device call of <= 9 minutes, on an H100 where
# one is lent (the start-up target is an H100's; the last five calls all got H200s):
#   FIRST_LIGHT_STEPS="environment train fp8 recipe ladder" TRAIN_STEPS=40 RECIPE_SEEDS=2 LADDER_RUNGS=11 \
#       scripts/gpu_first_light.sh OUT --cache .gpu/cache --peer-dir .gpu/build-nanogpt --time-limit 510
# and reads from summary.md: the start-up line (32.0 s on a fresh H200 on 2026-12-04, the compile 12.7 s of it;
# target <= 45 s on an H100); tok/s at the micro-batch auto picks (H200: 504-532k, MFU 44-46%, on three machines;
# target 560k) and with the FP8 head (553-558k); the recipe step's Muon + wsd against AdamW + cosine over two seeds
# (one seed on an H200: AdamW's final val in 19.9% of its tokens); rung 11 against build-nanogpt (1.04x at B16).
# The gpus, fsdp and cpu_speed steps ran on 2026-12-04, the loss, tests and cpu steps on 2026-11-26/27 (the unit
# tests on the box's AMX Xeon: 310 passed, the one failure fixed since).
# BENCHMARKS.md, "GPU", has every figure so far, with the GPU, torch and command.
set -uo pipefail

usage() {
    echo "usage: $0 OUT_DIR [--dry-run] [--data-dir DIR] [--cache DIR] [--peer-dir DIR] [--wheels DIR]" \
        "[--time-limit SECONDS]" >&2
}
die() { echo "error: $*" >&2; exit 2; }

[[ $# -ge 1 && $1 != -* ]] || { usage; die "give the output folder first"; }
OUT=$1
shift
DRY=0 DATA=data/default PEER="" WHEELS="" LIMIT=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --dry-run) DRY=1 ;;
        --data-dir) DATA=${2:?--data-dir needs a folder}; shift ;;
        --cache) export BOOKGPT_CACHE=${2:?--cache needs a folder}; shift ;;
        --peer-dir) PEER=${2:?--peer-dir needs a folder}; shift ;;
        --wheels) WHEELS=${2:?--wheels needs a folder}; shift ;;
        --time-limit) LIMIT=${2:?--time-limit needs seconds}; shift ;;
        *) usage; die "unknown argument $1" ;;
    esac
    shift
done

ALL_STEPS="environment tests train recipe fp8 ladder loss nccl hellaswag cpu cpu_speed gpus fsdp"
STEPS=${FIRST_LIGHT_STEPS:-$ALL_STEPS}
for name in $STEPS; do
    [[ " $ALL_STEPS " == *" $name "* ]] || die "unknown step $name in FIRST_LIGHT_STEPS (the steps: $ALL_STEPS)"
done

# Paths as given (from the caller's folder), then the commands run from the repository root.
absolute() { [[ -z $1 || $1 == /* ]] && echo "$1" || echo "$PWD/$1"; }
OUT=$(absolute "$OUT") DATA=$(absolute "$DATA") PEER=$(absolute "$PEER") WHEELS=$(absolute "$WHEELS")
[[ -z ${BOOKGPT_CACHE:-} ]] || BOOKGPT_CACHE=$(absolute "$BOOKGPT_CACHE")
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ ! -e $OUT || -z $(ls -A "$OUT") ]] || die "$OUT is not empty: give a new folder (nothing in it is replaced)"
[[ -f $DATA/manifest.json ]] || die "no prepared corpus in $DATA (manifest.json): prepare it where there is network \
(python -m data_prep.prepare --source default --out $DATA) and carry it along"
[[ -z $PEER || -f $PEER/train_gpt2.py ]] || die "no train_gpt2.py in --peer-dir $PEER"
[[ -z $LIMIT || $LIMIT =~ ^[0-9]+$ ]] || die "--time-limit takes whole seconds, not $LIMIT"
if [[ -n $WHEELS ]]; then
    compgen -G "$WHEELS/*.whl" >/dev/null || die "no *.whl in --wheels $WHEELS"
    SITE=$(mktemp -d)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
        || die "installing the wheels of $WHEELS failed"
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ $DRY == 0 ]]; then  # GPT-2 124M would train on the CPU for up to --time-limit a step (where torch imports
    # not, the environment step says why)
    why=$($PY -c "import torch; from training.distributed import why_no_gpu
torch.cuda.is_available() or print(why_no_gpu())" 2>/dev/null)
    [[ -z $why ]] || die "no CUDA GPU here: $why; these checks are a GPU's: --dry-run runs them on the CPU"
fi
mkdir -p "$OUT" || die "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1

VERDICT_TEST=tests/training/test_loop.py::test_the_one_step_late_verdict_trains_exactly_like_the_immediate_one
ADAMW="adamw-cosine=--optimizer adamw --lr-schedule cosine"  # the recipe step's baseline: GPT-2's AdamW + cosine
if [[ $DRY == 1 ]]; then  # toy sizes on the CPU: the same commands end to end, 1.5-2 minutes of CPU time
    PRESET=tiny-cpu DEVICE=cpu MB=2 TRAIN_YAML=accelerate_configs/cpu_eager.yaml
    DDP_YAML=accelerate_configs/cpu_ddp2.yaml  # MULTI_GPU: one process over gloo where there is no CUDA
    # --peak-tflops: a given MFU peak spares each run (and the ladder step) the CPU's matmul probes (~1.5 s), which a
    # GPU run never makes (a GPU's is its datasheet's); the cpu_speed step measures its own, the MFU it reports
    TRAIN_ARGS=(--config configs/tiny_cpu.yaml --max-steps 2 --log-interval 1 --eval-interval 2 --eval-windows 2
        --sample-interval 2 --checkpoint-interval 2 --micro-batch-size auto --peak-tflops 1)
    DDP_ARGS=(--config configs/tiny_cpu.yaml --max-steps 2 --log-interval 1 --peak-tflops 1)
    FSDP_YAML=(accelerate_configs/cpu_fsdp2.yaml --dynamo_backend eager)  # test_sharded.py compiles it (aot_eager)
    FSDP_ARGS=(--config configs/tiny_cpu.yaml --max-steps 2 --log-interval 1 --eval-interval 2 --eval-windows 2
        --sample-interval 0 --checkpoint-interval 2 --peak-tflops 1)
    TESTS=(tests/modeling/test_fused_ce.py::test_ignored_rows_get_zero_gradient "$VERDICT_TEST")
    # 8 val windows: its 12 evals (2 recipes x 3 points x 2 val sets) on tiny_cpu.yaml's 64 took 20 of its 32 s
    RECIPE_ARGS=(--config configs/tiny_cpu.yaml
        --set "--max-steps 2 --eval-windows 8 --peak-tflops 1 --data-dir '$DATA'" --eval-every 1 --seeds 1
        --accelerate-config "$TRAIN_YAML" --recipe default --recipe "$ADAMW")
    SHORT_ARGS=(--config configs/tiny_cpu.yaml --max-steps 2 --log-interval 1 --peak-tflops 1)
    # the GPU YAMLs compile per block; cpu_eager.yaml compiles nothing: dynamo's eager backend, per block
    TRAIN_COMPILE=(--dynamo_backend eager --dynamo_use_regional_compilation)
    LADDER_ARGS=(--rungs 0,11 --warmup 1 --steps 1 --accelerate-config "$TRAIN_YAML" --dynamo-backend eager
        --peak-tflops 1)
    LOSS_ARGS=(--warmup 1 --steps 1 --micro-batch-size 1 --dynamo-backend eager)
    HELLASWAG=${HELLASWAG_LIMIT:-4}
    CPU_TESTS=(tests/modeling/test_fused_ce.py::test_all_targets_ignored_is_nan_with_zero_grads_like_cross_entropy)
    CPU_WORKERS=0
    CPU_SPEED_ARGS=(--preset tiny-cpu --micro-batch-size 1 --warmup 1 --steps 1 --dynamo-backend eager)
    BACKEND=gloo
else
    PRESET=gpt2-124m DEVICE=cuda MB=16 TRAIN_YAML=accelerate_configs/1xgpu.yaml
    DDP_YAML=accelerate_configs/8xh100.yaml
    TRAIN_ARGS=(--max-steps "${TRAIN_STEPS:-200}" --log-interval 25 --eval-interval 100 --sample-interval 100
        --checkpoint-interval "${TRAIN_STEPS:-200}" --micro-batch-size auto)
    DDP_ARGS=(--max-steps 20 --log-interval 5)
    FSDP_YAML=(accelerate_configs/8xh100_fsdp.yaml)
    FSDP_ARGS=(--max-steps "${FSDP_STEPS:-30}" --log-interval 10 --eval-interval "${FSDP_STEPS:-30}"
        --sample-interval 0 --checkpoint-interval "${FSDP_STEPS:-30}" --micro-batch-size auto)
    TESTS=(tests/modeling/test_fused_ce.py tests/modeling/test_fp8_head.py "$VERDICT_TEST")
    # 64k-token steps: 100 of them are 3.8 epochs of data/default's 1.7M train tokens (the recipe's 524k-token step
    # would repeat the corpus 4 times in 13 steps)
    RECIPE_ARGS=(--set "--total-batch-tokens 65536 --max-steps 100 --warmup-steps 10 --data-dir '$DATA'"
        --eval-every 10 --seeds "${RECIPE_SEEDS:-2}" --recipe default --recipe "$ADAMW")
    SHORT_ARGS=(--max-steps "${SHORT_STEPS:-30}" --log-interval 10 --micro-batch-size auto)
    TRAIN_COMPILE=()  # 1xgpu.yaml's: inductor, per block
    LADDER_ARGS=(--rungs "${LADDER_RUNGS:-0,2,5,7,9,11}" --profile-steps 3)
    LOSS_ARGS=()
    HELLASWAG=${HELLASWAG_LIMIT:-2000}
    CPU_TESTS=(-m "not slow" tests/modeling tests/training) CPU_WORKERS=${CPU_TEST_WORKERS:-8}
    CPU_SPEED_ARGS=(--preset small-cpu)
    BACKEND=nccl
fi
LAUNCH=($PY -m accelerate.commands.launch -q)
[[ -n $LIMIT ]] || LIMIT=$([[ $DRY == 1 ]] && echo 86400 || echo 540)
DEADLINE=$(($(date +%s) + LIMIT))
PEER_ARGS=()
[[ -n $PEER ]] && PEER_ARGS=(--peer-dir "$PEER")

FAILED=0 N=0
{
    echo "# First light: $(date -u +'%Y-%m-%d %H:%M UTC')$([[ $DRY == 1 ]] && echo ' (--dry-run, CPU)')"
    echo
    echo "| step | status | seconds | log |"
    echo "|---|---|---:|---|"
} >"$OUT/summary.md"

pack() {  # logs and figures, not the run's weights (checkpoints, export)
    tar czf "$OUT/first_light.tgz" -C "$OUT" --exclude=first_light.tgz --exclude=checkpoints \
        --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude=tokenizer.json . 2>/dev/null
}
trap 'pack' EXIT

limited() {  # run "$@" until --time-limit (the time left now, not at its step's start), its process group too
    local left=$((DEADLINE - $(date +%s)))
    timeout -k 10 $((left > 1 ? left : 1)) "$@"
}

step() {  # step NAME COMMAND...: run it within the time left, log and time it, go on whatever it returns
    local name=$1 log start rc status
    shift
    N=$((N + 1))
    log=$(printf '%02d-%s.log' "$N" "$name")
    start=$(date +%s)
    if ((DEADLINE - start < 15)); then
        FAILED=1
        echo "| $N $name | skipped: --time-limit reached | 0 | |" | tee -a "$OUT/summary.md"
        return
    fi
    echo "== $N $name: $*" | tee "$OUT/$log"
    if [[ $(type -t "$1") == function ]]; then "$@"; else limited "$@"; fi >>"$OUT/$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="stopped at --time-limit" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    ((rc == 0)) || FAILED=1
    echo "| $N $name | $status | $(($(date +%s) - start)) | $log |" | tee -a "$OUT/summary.md"
    tail -n 3 "$OUT/$log"
}

environment() {
    uname -a
    command -v nvidia-smi >/dev/null && nvidia-smi
    limited $PY - <<'EOF'
import importlib.metadata as md, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"devices {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
for name in ("accelerate", "transformers", "tiktoken", "numpy", "safetensors", "pyyaml", "tqdm", "matplotlib",
             "triton", "datasets", "pyarrow", "deepspeed"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
from training.compile_cache import missing_build_tools  # what a compiling launch checks at its start
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch.compile's build tools ({device.type}): {missing_build_tools(device) or 'found'}")
EOF
    # everything the steps import must be here (datasets only builds shards: not needed)
    limited $PY -c "import train_accel, bench.ladder, bench.loss_speed, bench.loss_numerics, evals.__main__, pytest"
}

cpu_named() {  # the CPU, its ISA, and which logical CPUs share a physical core with cpu_speed's two
    lscpu | grep -E "^(Model name|CPU\(s\)|Thread\(s\) per core):"
    echo "ISA: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    # two threads on one core's siblings share its matmul units (AMX's tiles too): the peak the MFU is judged by,
    # one thread's rate x 2, is then out of reach (bench.profile's "threads at once" line measures it; a VM's vCPUs
    # may be siblings on the host whatever this topology says)
    local c
    for c in 0 1; do
        echo "cpu$c: core siblings $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null || echo '?')"
    done
}

cpu_tests() {  # -v: each result on its own line as it comes, so a step stopped at --time-limit still names them
    cpu_named
    local workers=()
    ((CPU_WORKERS > 0)) && $PY -c "import xdist" 2>/dev/null && workers=(-n "$CPU_WORKERS" --dist loadfile)
    # each failure's traceback as it comes: pytest prints them at its end, which a stop at --time-limit never reaches
    # (2026-11-27: 2 failed and 12 errored on the H200 box's Xeon, and the reasons were lost so)
    cat >"$OUT/report_now.py" <<'EOF'
def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n---- {report.nodeid} ({report.when}):\n{report.longreprtext}\n", flush=True)
EOF
    limited env PYTHONPATH="$OUT${PYTHONPATH:+:$PYTHONPATH}" $PY -m pytest -v -p no:cacheprovider -p report_now \
        --tb=short "${workers[@]}" "${CPU_TESTS[@]}"
}

cpu_speed() {  # two cores, as the CI VMs and a laptop have them; all of them where taskset is missing
    local pin=(taskset -c 0,1)
    command -v taskset >/dev/null || { pin=(); echo "note: no taskset here: the step runs on every core"; }
    cpu_named
    limited env OMP_NUM_THREADS=2 "${pin[@]}" $PY -m bench.ladder --device cpu --rungs 11 \
        --accelerate-config accelerate_configs/cpu_bf16.yaml --data-dir "$DATA" --out "$OUT/cpu_speed" \
        "${CPU_SPEED_ARGS[@]}" || return
    # where that step's time goes (the same shape and step counts): each matmul's time within it, the softmax, the rest
    limited env OMP_NUM_THREADS=2 "${pin[@]}" $PY -m bench.profile --precision bf16 --threads 2 \
        --data-dir "$DATA" "${CPU_SPEED_ARGS[@]}" | tee "$OUT/cpu_speed/profile.md"
}

numerics() {
    # -x: the first failure's traceback is printed at once, so a step stopped at --time-limit still shows it (on
    # 2026-11-26 evening two such steps were stopped with an F among the dots and no traceback)
    limited $PY -m pytest -q -x --tb=short -p no:cacheprovider "${TESTS[@]}" || return
    [[ $DRY == 1 ]] && { echo "bench.loss_numerics: left out of --dry-run (it compiles with inductor)"; return; }
    limited $PY -m bench.loss_numerics --device cuda
}

nccl() {  # the MULTI_GPU YAML in one process: the process group's backend must be NCCL (gloo on the CPU)
    local yaml=(--config_file "$DDP_YAML" --num_processes 1) probe=$OUT/nccl_probe.py
    cat >"$probe" <<'EOF'
import os

import torch
import torch.distributed as dist
from accelerate import PartialState

state = PartialState(cpu=not torch.cuda.is_available())
assert dist.is_initialized(), f"no process group under {state.distributed_type}"
t = torch.full((1,), 3.0, device=state.device)
dist.all_reduce(t)
print(f"distributed_type {state.distributed_type}, backend {dist.get_backend()}, world size "
      f"{dist.get_world_size()}, all_reduce of 3 on {t.device}: {t.item()}", flush=True)
dist.destroy_process_group()
# as modeling.runtime.exit_process ends a run: gloo's threads can abort the interpreter's teardown ("terminate
# called without an active exception", SIGABRT; seen once in this step's CI dry run, after the line above)
os._exit(0)
EOF
    limited env NCCL_DEBUG=INFO "${LAUNCH[@]}" "${yaml[@]}" "$probe" | tee "$OUT/nccl_backend.txt" || return
    grep -q "backend $BACKEND," "$OUT/nccl_backend.txt" || { echo "error: the backend is not $BACKEND"; return 1; }
    # the process group and the steps, no export (the train step's) or its start-up check
    limited env NCCL_DEBUG=INFO "${LAUNCH[@]}" "${yaml[@]}" train_accel.py "${DDP_ARGS[@]}" "${QUIET[@]}" \
        --data-dir "$DATA" --out-dir "$OUT/nccl"
}

gpus() {  # more processes than GPUs: one line, from check_launch, before any process group or model
    [[ $DRY == 1 ]] && { echo "dry run: no GPU to count (test_accelerate_configs.py tests the line)"; return; }
    local n
    n=$(nvidia-smi -L | grep -c '^GPU ')  # not its MIG devices' lines
    ((n < 8)) || { echo "this machine has $n GPUs: 8xh100.yaml fits, nothing to check"; return; }
    limited "${LAUNCH[@]}" --config_file accelerate_configs/8xh100.yaml train_accel.py --preset tiny-cpu \
        --max-steps 1 "${QUIET[@]}" --data-dir "$DATA" --out-dir "$OUT/gpus" >"$OUT/gpus.out" 2>&1
    local rc=$?
    cat "$OUT/gpus.out"
    ((rc == 1)) || { echo "error: exit status $rc, not 1"; return 1; }
    grep -q "^error: the launch starts 8 processes on this machine, one per GPU, but it has $n GPU(s)" "$OUT/gpus.out" \
        || { echo "error: no one-line refusal above"; return 1; }
}

QUIET=(--eval-interval 0 --sample-interval 0 --checkpoint-interval 0 --export-hf false)
for name in $STEPS; do
    case $name in
        environment) step environment environment ;;
        tests) step tests numerics ;;
        train) step train env TORCH_LOGS=recompiles,graph_breaks "${LAUNCH[@]}" --config_file "$TRAIN_YAML" \
            "${TRAIN_COMPILE[@]}" train_accel.py "${TRAIN_ARGS[@]}" --data-dir "$DATA" --out-dir "$OUT/train" ;;
        recipe) step recipe $PY -m bench.time_to_loss "${RECIPE_ARGS[@]}" --baseline adamw-cosine --out "$OUT/recipe" ;;
        fp8) step fp8 "${LAUNCH[@]}" --config_file "$TRAIN_YAML" train_accel.py "${SHORT_ARGS[@]}" "${QUIET[@]}" \
            --fp8-head true --data-dir "$DATA" --out-dir "$OUT/fp8" ;;
        ladder) step ladder $PY -m bench.ladder --preset "$PRESET" --device "$DEVICE" --micro-batch-size "$MB" \
            --data-dir "$DATA" --out "$OUT/ladder" "${LADDER_ARGS[@]}" "${PEER_ARGS[@]}" ;;
        loss) step loss $PY -m bench.loss_speed --preset "$PRESET" --device "$DEVICE" --micro-batch-size "$MB" \
            --out "$OUT/loss" "${LOSS_ARGS[@]}" ;;
        nccl) step nccl nccl ;;
        cpu) step cpu cpu_tests ;;
        cpu_speed) step cpu_speed cpu_speed ;;
        gpus) step gpus gpus ;;
        fsdp) step fsdp "${LAUNCH[@]}" --config_file "${FSDP_YAML[@]}" --num_processes 1 train_accel.py \
            "${FSDP_ARGS[@]}" --data-dir "$DATA" --out-dir "$OUT/fsdp" ;;
        hellaswag) step hellaswag $PY -m evals --model "$OUT/train/export" --tasks hellaswag --limit "$HELLASWAG" \
            --json "$OUT/hellaswag.json" ;;
    esac
done

{
    echo
    for log in "$OUT"/*-train.log "$OUT"/*-fp8.log "$OUT"/*-fsdp.log; do
        [[ -f $log ]] || continue
        echo "## $(basename "$log"): the compile, the micro-batch, the start-up, the FP8 head"
        echo
        grep -aoE "dynamo [A-Z_]+( per block)?|(micro-batch: auto|start-up:|note: fp8_head) .*" "$log"
        # the train step's compiles beyond the first (its compile took ~10 s more than the ladder's of the same step)
        grep -aE "\[__(recompiles|graph_breaks)\] (Recompiling|Graph break)" "$log" | cut -c1-300 | head -10
        echo
    done
    cpu_log=$(compgen -G "$OUT/*-cpu.log")
    if [[ -n $cpu_log ]]; then
        echo "## cpu: the unit tests on this machine's CPU"
        echo
        grep -aE "^(Model name|Thread\(s\) per core|ISA|cpu[01]):" "$cpu_log"
        grep -aE "(FAILED|ERROR) tests/|tests/\S+ (FAILED|ERROR)|^=+ .*(passed|failed|error)" "$cpu_log" | sort -u
        echo
        grep -aE "^(---- |E  )" "$cpu_log" | head -80  # each failure and its error lines (report_now.py)
        echo
    fi
    cpu_speed_log=$(compgen -G "$OUT/*-cpu_speed.log")
    if [[ -n $cpu_speed_log ]]; then
        echo "## cpu_speed: the CPU it ran on (taskset -c 0,1)"
        echo
        grep -aE "^(Model name|Thread\(s\) per core|ISA|cpu[01]):" "$cpu_speed_log"
        echo
    fi
    for f in ladder/ladder.md loss/loss_speed.md cpu_speed/ladder.md cpu_speed/profile.md; do
        [[ -f $OUT/$f ]] && { echo "## $f"; echo; cat "$OUT/$f"; echo; }
    done
    recipe_log=$(compgen -G "$OUT/*-recipe.log")
    if [[ -n $recipe_log ]]; then  # bench.time_to_loss prints its tables last, from its command line on
        echo "## recipe: bench.time_to_loss"
        sed -n '/^python -m bench.time_to_loss/,$p' "$recipe_log"
        echo
    fi
    for run in train fp8 fsdp; do
        if [[ -f $OUT/$run/metrics.jsonl ]]; then
            echo "## $run/metrics.jsonl (last rows)"
            echo
            tail -n 3 "$OUT/$run/metrics.jsonl"
            echo
        fi
    done
} >>"$OUT/summary.md"
echo "summary: $OUT/summary.md; logs and figures: $OUT/first_light.tgz"
exit $FAILED
