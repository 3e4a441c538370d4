"""Shared fixtures: prepared books, a tiny GPT, an eval run folder (the embedded corpus and the eval data are
downloaded once into the user cache, then offline)."""

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

# Under pytest-xdist, each worker and every process it launches computes on its share of the cores (set before torch
# starts its thread pool; accelerate launch passes it on): workers of all-core thread pools on the same cores spin on
# each other's OpenMP barriers, and a tiny step then takes seconds instead of milliseconds. Inductor's compile workers
# likewise: a process compiling C++ starts one worker per core it sees, each a fresh interpreter importing torch; on
# a share of one core they compile nothing sooner (the README run's compile on an empty cache: 90 s of CPU with the
# two a 2-core Zen 3 gives it, 77 s with one). A run alone on the cores keeps them: its compile ends sooner so.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    share = str(max(1, os.cpu_count() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", share)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", share)

import pytest  # noqa: E402
import torch  # noqa: E402
from accelerate.state import AcceleratorState
from warm_launch import set_up_by_the_process

from data_prep.prepare import prepare
from evals.data import provision
from modeling.config import GPTConfig
from modeling.gpt import GPT
from modeling.vector_math import warm_up_vector_math
from testkit import NO_DATASETS, TINY_MODEL, distinct_gpt, new_run, write_checkpoint
from training.checkpoint import checkpoint_dir
from training.compile_cache import set_up_compile_cache

# Four plays of the embedded corpus; with val_fraction 0.1 Twelfth Night is the val book.
BOOKS_SOURCE = "default:hamlet,macbeth,tempest,twelfth_night"


@pytest.fixture(scope="session", autouse=True)
def cpu_process_set_up() -> None:
    """As train_accel.py sets up its processes, for the tests that compute in this one: a compile cache per ISA,
    and no first call of MKL's vector math inside a comparison."""
    set_up_compile_cache(torch.device("cpu"))
    warm_up_vector_math(torch.device("cpu"))


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo() -> None:
    """Each test file compiles from dynamo's initial state, as a process of its own would. Otherwise a function an
    earlier file compiled in this worker (GPT.forward) is recompiled at a new shape with symbolic sizes (automatic
    dynamic shapes): another graph, whose compile-cache key hangs on which files this worker ran first, so a warm
    cache missed and the file built C++ for minutes (the compiled activation-checkpointing test: 125 s, 8 s on a
    hit). Within a file the order is fixed, and a file's tests may share a compiled function's graphs."""
    if "torch._dynamo" in sys.modules:  # an eager file never imports it (1.9 s)
        torch._dynamo.reset()


@pytest.fixture(autouse=True)
def environment_kept() -> Iterator[None]:
    """Fails a test that leaves os.environ changed, and puts it back (monkeypatch's own changes are undone before this
    looks). A variable left behind reaches every later test in this worker and the processes they launch: a launch
    YAML's ACCELERATE_DYNAMO_BACKEND, set by a CLI's main called in-process, once made the rest of a worker's tests
    train compiled, and the suite took 4.5 minutes longer."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(
        k for k in before.keys() | after.keys() if before.get(k) != after.get(k) and not set_up_by_the_process(k)
    )
    if changed:
        for k in changed:
            if k in before:
                os.environ[k] = before[k]
            else:
                del os.environ[k]
        pytest.fail(f"the test left these environment variables changed: {', '.join(changed)}")


@pytest.fixture(autouse=True)
def consistent_matmul_precision() -> Iterator[None]:
    """After each test, torch's fp32 matmul flags back to one consistent state (fp32, no TF32). The training loop run
    in-process turns TF32 on through the legacy allow_tf32; a later set_float32_matmul_precision("high") and
    allow_tf32 = False then leave CUDA's flag and oneDNN's apart, where torch.get_float32_matmul_precision() raises
    ("mix of the legacy and new APIs"), so a test's outcome would hang on the order the tests ran in."""
    yield
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture
def fp8_matmul() -> None:
    """Skips a test of torch._scaled_mm on the CPU only where oneDNN, held to an older ISA by ONEDNN_MAX_CPU_ISA
    (this project's AVX2 emulation), has no FP8 kernel for torch to hand the matmul to: an AMX Xeon under
    ONEDNN_MAX_CPU_ISA=AVX2. It ran everywhere else so far: natively on every CPU, and on a Cascade Lake under the
    same cap. Asked per test, after the session's set-up: on the AMX Xeon under the cap the matmul ran in a process
    that had not imported inductor, and failed in one that had, as tests do."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except RuntimeError as e:
        if "ONEDNN_MAX_CPU_ISA" in os.environ and "primitive descriptor" in str(e):
            pytest.skip("oneDNN has no FP8 matmul under this ONEDNN_MAX_CPU_ISA on this CPU")
        raise


@pytest.fixture(scope="session")
def prepared_books(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared data dir: ~117k train tokens in 3 shards, ~37k val tokens in 1 shard. Read-only."""
    pytest.importorskip("datasets", reason=NO_DATASETS)
    out = tmp_path_factory.mktemp("prepared") / "books"
    prepare(BOOKS_SOURCE, out, shard_tokens=40_000, val_fraction=0.1)
    return out


@pytest.fixture(scope="module")
def tiny_gpt() -> GPT:
    """A 2-layer, 32-wide GPT (padded vocab) in eval mode whose LayerNorms and biases are non-trivial."""
    return distinct_gpt(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50304))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder as training leaves it: config.yaml and two checkpoints, the newest from a compiled model
    (keys prefixed `_orig_mod.`)."""
    provision()
    run = new_run(tmp_path_factory.mktemp("evals"))
    for step in (1, 2):
        torch.manual_seed(step)
        model = GPT(TINY_MODEL)
        write_checkpoint(torch.compile(model) if step == 2 else model, checkpoint_dir(run, step))
    return run


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one state per process, its device and precision set by the first Accelerator: a test that
    builds its own starts from none, and leaves none behind for the tests after it."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """mount(size) -> an empty filesystem of that size ("2m"): a tmpfs, a real disk that fills up. Skipped where this
    process may not mount one (not root); unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]
        if subprocess.run(command, capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (mounting needs root)")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test files that launch processes first, each file's tests in their order: `make test`'s workers take whole
    files in this order (--no-loadscope-reorder), so the long ones start early and the quick ones fill in, rather
    than one long file running alone at the end."""
    launches = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in launches)
