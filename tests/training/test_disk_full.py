"""A full disk while training writes metrics, plots and exports: one line, nothing partial, and the same command
goes on once there is room; and the start-up's warning where the checkpoints will not fit. Real full disks (a small
tmpfs); checkpoint saves are in tests/e2e/test_resume.py and prepared shards in tests/data_prep/test_prepare.py."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from modeling.disk import DiskFull
from modeling.gpt import GPT
from modeling.runs import read_metrics
from testkit import TINY_MODEL, fill_disk, new_run, write_checkpoint
from training.checkpoint import checkpoint_dir, room_warning
from training.export import main as export_main
from training.metrics import JSONLTracker, plot_losses


def test_metrics_rows_stay_whole_on_a_full_disk_and_go_on_after_room_is_made(tmpfs):
    disk = tmpfs("1m")
    tracker = JSONLTracker(disk)
    tracker.log({"train_loss": 5.0}, step=1)
    plot_losses(disk / "metrics.jsonl", disk / "loss.png")
    plot = (disk / "loss.png").read_bytes()
    filler = fill_disk(disk)
    with pytest.raises(DiskFull) as err:
        tracker.log({"train_loss": 4.0, "note": "x" * 20_000}, step=2)  # more than the page the file has left
    assert re.fullmatch(
        rf"disk full while writing {disk}/metrics.jsonl: free space on {disk} and run the same command again; "
        r"metrics.jsonl keeps every complete row, the checkpoints are untouched",
        str(err.value),
    )
    assert (disk / "metrics.jsonl").read_text() == '{"step": 1, "train_loss": 5.0}\n'
    tracker.log({"train_loss": 4.5}, step=2)
    with pytest.raises(OSError, match="No space left on device"):
        plot_losses(disk / "metrics.jsonl", disk / "loss.png")
    assert (disk / "loss.png").read_bytes() == plot  # the last whole plot, and no partial file beside it
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "loss.png", "metrics.jsonl"]

    filler.unlink()
    tracker.log({"train_loss": 4.0}, step=2)
    assert [r["train_loss"] for r in read_metrics(disk / "metrics.jsonl")] == [5.0, 4.0]


def test_the_start_up_warns_where_the_checkpoints_kept_and_the_one_being_written_do_not_fit(tmpfs):
    """A run keeps --keep-checkpoints and writes each new one before pruning the oldest: the warning counted two,
    so a run keeping two (the default) on room for two trained on until its third save failed, unwarned. A wsd run
    keeps one more, from before its decay, and a run with val evals its best-val one."""
    run_dir = tmpfs("10m") / "run"
    run_dir.mkdir()
    four_mb = 4 * 2**20
    assert room_warning(run_dir, four_mb, keep=1) is None  # 2 x 4 MB in 10 MB
    assert re.fullmatch(
        rf"warning: out_dir {run_dir} has 10 MB free, less than 3 more checkpoints need \(12 MB: --keep-checkpoints 2, "
        r"and one more while a save writes\); a save will fail: free space, lower --keep-checkpoints or choose another "
        r"--out-dir",
        room_warning(run_dir, four_mb, keep=2) or "",
    )
    checkpoint_dir(run_dir, 1).mkdir(parents=True)  # one is there: two more to come
    assert room_warning(run_dir, four_mb, keep=2) is None
    assert "less than 1 more checkpoint need (12 MB: --keep-checkpoints 1," in room_warning(run_dir, 12 * 2**20, keep=1)
    # a wsd run also keeps its checkpoint from before the decay: one more at once (the room for two more fit above)
    warned = room_warning(run_dir, four_mb, keep=2, before_decay=True) or ""
    assert "less than 3 more checkpoints need (12 MB: --keep-checkpoints 2, the one from before the wsd" in warned
    # a run with val evals keeps its best-val checkpoint, an extra one once the val loss stops falling (the room for
    # two more fit without it); both with it
    warned = room_warning(run_dir, four_mb, keep=2, best_val=True) or ""
    assert "less than 3 more checkpoints need (12 MB: --keep-checkpoints 2, the best-val one, and one more" in warned
    warned = room_warning(run_dir, 3 * 2**20, keep=2, best_val=True, before_decay=True) or ""
    assert (
        "less than 4 more checkpoints need (12 MB: --keep-checkpoints 2, the best-val one, the one from before"
        in warned
    )


def test_an_export_on_a_full_disk_says_so_leaves_nothing_and_completes_after_room_is_made(tmp_path, tmpfs):
    run = new_run(tmp_path)
    torch.manual_seed(0)
    write_checkpoint(GPT(TINY_MODEL), checkpoint_dir(run, 1))
    disk = tmpfs("2m")  # the export is ~13 MB
    out = disk / "export"
    with pytest.raises(SystemExit) as err:
        export_main([str(run), "--out", str(out)])
    assert str(err.value) == (
        f"error: disk full while writing {out}: free space on {disk} and run the same command again; "
        f"{checkpoint_dir(run, 1)} is untouched and nothing of the export is left"
    )
    assert list(disk.iterdir()) == []
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    export_main([str(run), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == [
        "bookgpt.json", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
