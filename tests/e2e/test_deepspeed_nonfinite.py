"""DeepSpeed steps inside accelerator.backward, before the Trainer sees the gradient norm: a step reported as skipped
must really have changed no weight. Two processes of the ZeRO-2 CPU twin (cpu_zero2.yaml) over gloo, in fp32 and
in bf16 (the GPU YAMLs' precision), with the gradients made NaN during one train_step call."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit import ACCELERATE_LAUNCH, REPO, WarmLaunches, free_port, run

pytestmark = pytest.mark.slow

# Run by `accelerate launch` in each rank: 4 train_step calls of the real Trainer on a tiny model, NaN gradients
# in call BAD; rank 0 writes what each call left behind.
SCRIPT = """
import json, sys
import torch
from modeling.runtime import finish
from training.distributed import build_accelerator, set_deepspeed_batch
from training.config import TrainConfig
from training.optim import build_optimizer, build_scheduler
from training.step import Trainer

out, bad = sys.argv[1], int(sys.argv[2])
accelerator = build_accelerator(grad_clip=1.0, step_scheduler_with_optimizer=False)
accelerator.gradient_accumulation_steps = 2
set_deepspeed_batch(accelerator, 4, 2)


class ModelWithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        out = self.lin(x.to(self.lin.weight.dtype))  # DeepSpeed bf16 holds the weights in bf16, no autocast
        return out, torch.nn.functional.mse_loss(out.float(), y)


torch.manual_seed(0)
model = ModelWithLoss()
call = [0]
model.lin.weight.register_hook(lambda g: g * float("nan") if call[0] == bad else g)
optimizer = build_optimizer([{"params": list(model.parameters()), "weight_decay": 0.1}], lr=1e-2,
                            betas=(0.9, 0.95), device_type="cpu")
scheduler = build_scheduler(optimizer, TrainConfig(warmup_steps=1, max_steps=8, min_lr_ratio=0.1))
engine, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
trainer = Trainer(accelerator, engine, optimizer, scheduler, grad_accum=2, grad_clip=1.0, tokens_per_step=64,
                  max_bad_steps=3)
g = torch.Generator().manual_seed(1 + accelerator.process_index)
batches = iter(lambda: (torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)), None)
rows = []
for i in range(4):
    call[0] = i
    trainer.train_step(batches)
    trainer.settle()
    rows.append({"step": trainer.progress.step, "applied": engine.was_step_applied(),
                 "weight": engine.module.lin.weight.detach().float().tolist()})
if accelerator.is_main_process:
    json.dump(rows, open(out, "w"))
finish(accelerator)  # as train_accel.py ends: gloo's teardown can abort a finished run (exit -6)
"""


@pytest.fixture(scope="module")
def ds_steps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], WarmLaunches]]:
    """The script, and the warm server its ranks run in (testkit.WarmLaunches): each a copy of a process that has
    imported torch and the script's modules, ~3 s of CPU less than a fresh interpreter."""
    pytest.importorskip("deepspeed")
    folder = tmp_path_factory.mktemp("ds_steps")
    script = folder / "ds_steps.py"
    script.write_text(SCRIPT)
    # an extensions folder of the file's own: a JIT-compiled DeepSpeed op would land here
    launcher = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder / "torch_extensions")}
    # accelerate's DeepSpeed launcher puts its working folder (the repo) on the ranks' PYTHONPATH, whence the
    # script imports the project's modules; the launcher itself, without it, starts fresh
    with WarmLaunches(script, {**launcher, "PYTHONPATH": str(REPO)}) as warm:
        yield script, launcher, warm


def launch(ds_steps, tmp_path, launch_args: list[str], expect_rc: int = 0) -> subprocess.CompletedProcess:
    script, env, warm = ds_steps
    cmd = [
        *ACCELERATE_LAUNCH, *launch_args, "--main_process_port", str(free_port()),
        str(script), str(tmp_path / "rows.json"), "1",
    ]  # fmt: skip
    with warm.forking(2):  # both ranks ran warm
        result = run(cmd, expect_rc=expect_rc, timeout=300, env=env, warm=warm)
    # training's collectives are gloo's: nothing compiled (DeepSpeed's shared-memory all-reduce takes 1.5-2 min)
    extensions = Path(env["TORCH_EXTENSIONS_DIR"])
    assert not extensions.exists() or not any(extensions.iterdir())
    return result


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_step_reported_skipped_changes_no_weight(ds_steps, tmp_path, precision):
    yaml = ["--config_file", "accelerate_configs/cpu_zero2.yaml", "--mixed_precision", precision]
    result = launch(ds_steps, tmp_path, yaml)
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["step"] for r in rows] == [1, 1, 2, 3]  # call 1 skipped, and counted as such
    assert [r["applied"] for r in rows] == [True, False, True, True]  # DeepSpeed's own account agrees
    assert result.stdout.count("update skipped") == 1
    assert rows[1]["weight"] == rows[0]["weight"]  # the skipped step changed nothing
    assert rows[2]["weight"] != rows[1]["weight"]  # and training goes on


def test_a_non_finite_update_deepspeed_applied_stops_the_run(ds_steps, tmp_path):
    """bf16 with DeepSpeed's check_grad_overflow off applies the NaN update: the Trainer stops and says so."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True, "check_grad_overflow": False},
    }))  # fmt: skip
    args = ["--use_deepspeed", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "bf16",
            "--dynamo_backend", "no", "--deepspeed_config_file", str(config)]  # fmt: skip
    result = launch(ds_steps, tmp_path, args, expect_rc=1)
    assert "DeepSpeed applied step 2's update with non-finite gradients" in result.stdout + result.stderr
    assert not (tmp_path / "rows.json").exists()
