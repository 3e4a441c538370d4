"""Which checkpoint a launch continues from, and keeping a run folder to one run: a damaged checkpoint is named and
skipped (auto) or refused (a given path), one written before manifests still resumes, another model's folder stops,
and what a fresh start or a resume leaves behind is set aside, never mixed. Then the launcher's last line."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from modeling.runtime import report_error
from training.checkpoint import (
    MANIFEST,
    CheckpointError,
    before_decay_checkpoint,
    checkpoint_damage,
    checkpoint_dir,
    clear_partial,
    is_before_decay,
    list_checkpoints,
    outputs_in_the_way,
    plan_resume,
    prune_checkpoints,
    sample_header,
    sampled,
    set_aside,
    write_manifest,
)
from training.config import ConfigError, TrainConfig, config_to_yaml
from training.launch import _root_cause_line
from training.loop import optimizer_for_engine


def config(run_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig(preset="tiny-cpu", out_dir=str(run_dir), **overrides)


def fake_checkpoint(run_dir: Path, step: int, manifest: bool = True) -> Path:
    """A checkpoint folder with the kinds of file save_state writes (safetensors, a torch.save zip, JSON)."""
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    (folder / "sub").mkdir(parents=True)
    save_file({"w": torch.full((64, 64), float(step))}, str(folder / "model.safetensors"))
    torch.save({"state": torch.arange(100)}, folder / "optimizer.bin")
    (folder / "meta.json").write_text(json.dumps({"step": step}))
    (folder / "sub" / "shard.distcp").write_bytes(os.urandom(1000))
    (folder / "config.yaml").write_text(config_to_yaml(config(run_dir)))
    if manifest:
        write_manifest(folder)
    return folder


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


DAMAGES = {
    "truncated": (lambda f: truncate(f / "model.safetensors"), r"model.safetensors is 16,\d+ bytes, 16,\d+ when saved"),
    "missing": (lambda f: (f / "sub" / "shard.distcp").unlink(), r"sub/shard.distcp is missing"),
    "altered": (lambda f: (f / "meta.json").write_text('{"step": 9}'), r"meta.json does not match its sha256"),
    "bad_manifest": (lambda f: (f / MANIFEST).write_text("{"), r"its manifest.json is unreadable"),
}


@pytest.mark.parametrize(
    ("given", "listed"),
    [("other", "other"), ("other/checkpoints", "other"), ("other/checkpoints/step-00000009", "other"),
     ("Auto", "run"), ("nowhere", "run")],
)  # fmt: skip
def test_a_resume_path_that_is_no_checkpoint_lists_the_checkpoints_of_the_folder_given(tmp_path, given, listed):
    """A run folder or its checkpoints/ given to --resume listed out_dir's checkpoints (often none) instead of the
    folder's own, and so did a checkpoint of that run gone from it (pruned: the run keeps its newest); a
    capitalized word was taken for a path without a word about it."""
    other = [fake_checkpoint(tmp_path / "other", step) for step in (1, 2)]
    mine = fake_checkpoint(tmp_path / "run", 3)
    with pytest.raises(FileNotFoundError) as err:
        plan_resume(config(tmp_path / "run", resume=str(tmp_path / given) if given != "Auto" else given))
    word = " (the words are lowercase: auto)" if given == "Auto" else ""
    shown = [str(p) for p in (other if listed == "other" else [mine])]
    what = "not a checkpoint folder" if (tmp_path / given).exists() else "no such folder"
    assert str(err.value) == (
        f"--resume {tmp_path / given if given != 'Auto' else given}: {what} (expected "
        f".../checkpoints/step-NNNNNNNN, or auto or never){word}; complete ones in {tmp_path / listed}: {shown}"
    )


@pytest.mark.parametrize("damage", DAMAGES)
def test_auto_names_a_damaged_newest_checkpoint_and_resumes_the_newest_intact_one(tmp_path, damage):
    run_dir = tmp_path / "run"
    older, newest = fake_checkpoint(run_dir, 2), fake_checkpoint(run_dir, 4)
    assert checkpoint_damage(newest) is None
    harm, why = DAMAGES[damage]
    harm(newest)
    chosen, notes = plan_resume(config(run_dir))
    assert chosen == older
    [warning] = notes
    assert warning.startswith(f"warning: checkpoint {newest} is damaged (") and warning.endswith("); skipping it")
    assert re.search(why, warning), warning
    with pytest.raises(CheckpointError, match=rf"--resume {newest}: the checkpoint is damaged \(.*\); resume from "
                                              rf"another one of .*checkpoints \(step-00000002\)"):  # fmt: skip
        plan_resume(config(run_dir, resume=str(newest)))


def test_checkpoints_without_a_manifest_resume_unless_a_file_does_not_load(tmp_path):
    """Folders saved before manifests: a load test of safetensors, torch.save zips and JSON instead."""
    run_dir = tmp_path / "run"
    older, newest = fake_checkpoint(run_dir, 2, manifest=False), fake_checkpoint(run_dir, 4, manifest=False)
    assert plan_resume(config(run_dir)) == (newest, [])
    truncate(newest / "optimizer.bin")
    assert "optimizer.bin does not load (BadZipFile" in checkpoint_damage(newest)
    truncate(older / "model.safetensors")
    assert "model.safetensors does not load (SafetensorError" in checkpoint_damage(older)
    newest_first = (
        rf"out_dir {run_dir} has no intact checkpoint \(\S+step-00000004 is damaged \(optimizer.bin does not load "
        r"\(BadZipFile: .*\)\); \S+step-00000002 is damaged \(model.safetensors does not load .*\); restore one, or "
        r"start afresh with --resume never"
    )
    with pytest.raises(CheckpointError, match=newest_first):
        plan_resume(config(run_dir))
    assert plan_resume(config(run_dir, resume="never")) == (None, [])


@pytest.mark.parametrize(
    ("where", "text", "said"),
    [
        ("checkpoint", "max_steps: [\n", r" does not read as YAML \(while parsing"),
        ("checkpoint", "max_steps: -1\n", r": max_steps must be >= 1, got -1"),
        ("run folder", "- preset: tiny-cpu\n", r" is not a mapping of key: value"),
    ],
)
def test_a_saved_run_config_that_does_not_read_is_one_error_naming_it(tmp_path, where, text, said):
    """A checkpoint saved before manifests (nothing hashes its config.yaml) or a run folder's config.yaml edited by
    hand: PyYAML's or AttributeError's traceback, or the config's own complaint as if about this launch's flags."""
    run_dir = tmp_path / "run"
    checkpoint = fake_checkpoint(run_dir, 2, manifest=False)
    if where == "run folder":
        (checkpoint / "config.yaml").unlink()  # an older checkpoint: the run folder's config.yaml says
    path = (checkpoint if where == "checkpoint" else run_dir) / "config.yaml"
    path.write_text(text)
    with pytest.raises(CheckpointError) as err:
        plan_resume(config(run_dir, max_steps=4))
    assert re.fullmatch(
        rf"{re.escape(str(path))},? the run config it was saved with,?{said}.*; restore it from a copy, or start "
        r"afresh with --resume never",
        str(err.value),
    ), err.value


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save on one process, as intended here
def test_a_sharded_checkpoint_without_a_manifest_is_damaged_when_a_shard_is_short_or_missing(tmp_path):
    """FSDP2's torch.distributed.checkpoint folders, saved before manifests: .metadata says which bytes of which
    .distcp hold each tensor, so a shard cut short or gone is named before the resume loads it."""
    folder = tmp_path / "run" / "checkpoints" / "step-00000002"
    for sub, seed in (("pytorch_model_fsdp_0", 0), ("optimizer_0", 1)):
        g = torch.Generator().manual_seed(seed)
        dcp.save({"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}, checkpoint_id=folder / sub)
    (folder / "meta.json").write_text(json.dumps({"step": 2}))
    assert checkpoint_damage(folder) is None
    [shard] = (folder / "optimizer_0").glob("*.distcp")
    size = shard.stat().st_size
    truncate(shard)
    assert checkpoint_damage(folder) == (
        f"optimizer_0/{shard.name} is {size - 100:,} bytes, its tensors end at byte {size:,}"
    )
    shard.unlink()
    assert checkpoint_damage(folder) == f"optimizer_0/{shard.name} is missing"
    (folder / "optimizer_0" / ".metadata").write_bytes(b"not a pickle")
    assert checkpoint_damage(folder).startswith("optimizer_0/.metadata does not load (")


def test_a_folder_holding_another_models_run_stops_unless_told_to_start_afresh(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config_to_yaml(config(run_dir, block_size=32)))  # killed before any save
    other = rf"out_dir {run_dir} holds a run of a tiny-cpu \(.*block_size 32.*\) model, this run's is tiny-cpu"
    with pytest.raises(ConfigError, match=other + r" \(.*block_size 64.*\); .* --resume never"):
        plan_resume(config(run_dir))
    assert plan_resume(config(run_dir, block_size=32)) == (None, [])  # the same model: starts (nothing to resume)
    assert plan_resume(config(run_dir, resume="never")) == (None, [])
    fake_checkpoint(run_dir, 2)
    other = rf"out_dir {run_dir} holds a run \(step-00000002\): the checkpoint is a tiny-cpu \(.*\) model, this run's"
    with pytest.raises(ConfigError, match=other + r" is tiny-cpu \(.*block_size 32"):
        plan_resume(config(run_dir, block_size=32))


def test_a_run_of_its_own_shape_resumes_only_at_that_shape_and_the_line_names_both(tmp_path):
    """n_layer / n_head / n_embd are part of the shape a resume compares: the same launch again continues, another
    width stops with one line naming both shapes and the flags that set them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    own = {"n_layer": 3, "n_head": 4, "n_embd": 48}
    (run_dir / "config.yaml").write_text(config_to_yaml(config(run_dir, **own)))
    assert plan_resume(config(run_dir, **own)) == (None, [])
    checkpoint = fake_checkpoint(run_dir, 2)
    (checkpoint / "config.yaml").write_text(config_to_yaml(config(run_dir, **own)))
    write_manifest(checkpoint)
    assert plan_resume(config(run_dir, **own)) == (checkpoint, [])
    theirs = r"the checkpoint is a tiny-cpu \(n_layer 3, n_head 4, n_embd 48, block_size 64, .*\) model"
    ours = r"this run's is tiny-cpu \(n_layer 3, n_head 4, n_embd 64, block_size 64, .*\); resume with the checkpoint's"
    with pytest.raises(ConfigError, match=rf"{theirs}, {ours} --preset/--n-layer/--n-head/--n-embd/--block-size/"):
        plan_resume(config(run_dir, n_layer=3, n_head=4))


def test_a_resume_path_of_another_model_into_an_empty_folder_says_nothing_is_moved_aside(tmp_path):
    """--resume PATH of another model's checkpoint: "start afresh there with --resume never (the run is moved into
    previous-<time>/ first)" where the out_dir held no run, and nothing would be moved: said only where one is."""
    other_run, run_dir = tmp_path / "other", tmp_path / "run"
    checkpoint = fake_checkpoint(other_run, 2)  # tiny-cpu, block_size 64
    ask = config(run_dir, block_size=32, resume=str(checkpoint))
    with pytest.raises(ConfigError) as err:
        plan_resume(ask)
    assert str(err.value).endswith(", start afresh there with --resume never, or choose another --out-dir")
    fake_checkpoint(run_dir, 4)
    with pytest.raises(ConfigError) as err:
        plan_resume(ask)
    assert str(err.value).endswith(
        ", start afresh there with --resume never (the run is moved into previous-<time>/ first), or choose another "
        "--out-dir"
    )


def test_a_checkpoint_of_the_other_optimizer_stops_with_the_launch_that_resumes_it(tmp_path):
    """The advice follows where this launch's optimizer came from: the user's --optimizer, or a sharding engine
    that trains AdamW for the default Muon (loop.optimizer_for_engine), where --optimizer muon would not help."""
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 2)  # the default optimizer's, Muon
    held = rf"out_dir {run_dir} holds a run \(step-00000002\): the checkpoint holds muon state, "
    asked = config(run_dir, optimizer="adamw")
    asked.explicit = frozenset({"optimizer"})
    with pytest.raises(ConfigError, match=held + "this run asks for --optimizer adamw; resume with --optimizer muon"):
        plan_resume(asked)
    sharded, _ = optimizer_for_engine(config(run_dir), "DeepSpeed")
    with pytest.raises(ConfigError, match=held + r".* trains adamw; resume with a launch YAML of DDP or one process"):
        plan_resume(sharded)


def test_the_config_line_leaves_the_micro_batch_to_the_resume_line(tmp_path):
    """A changed micro-batch is said once, after the load, with the world size and accumulation it changes with."""
    run_dir = tmp_path / "run"
    newest = fake_checkpoint(run_dir, 2)
    assert plan_resume(config(run_dir, micro_batch_size=8)) == (newest, [])
    assert plan_resume(config(run_dir, micro_batch_size=8, max_steps=9)) == (
        newest,
        [f"resuming with a changed config (checkpoint -> now): max_steps {TrainConfig().max_steps} -> 9"],
    )


def test_the_config_line_names_a_field_the_checkpoints_config_predates(tmp_path):
    """An anneal of a run saved before --decay-steps existed (its config.yaml has no decay_steps): the line says
    decay_steps 0 -> 4, not nothing; the decay_fraction it overrides is left out."""
    run_dir = tmp_path / "run"
    newest = fake_checkpoint(run_dir, 2)
    saved = newest / "config.yaml"
    saved.write_text("".join(line for line in saved.read_text().splitlines(True) if "decay_steps" not in line))
    write_manifest(newest)  # the checkpoint as an older version saved it: intact
    anneal = config(run_dir, max_steps=14, decay_steps=4, decay_fraction=0.3)
    assert plan_resume(anneal) == (
        newest,
        [f"resuming with a changed config (checkpoint -> now): max_steps {TrainConfig().max_steps} -> 14, "
         "decay_steps 0 -> 4"],
    )  # fmt: skip


def test_a_fresh_start_sets_the_whole_previous_run_aside(tmp_path):
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 2)
    for name in ("config.yaml", "metrics.jsonl", "samples.txt", ".run.lock", ".run.lock.json"):
        (run_dir / name).write_text(name)
    (run_dir / "previous-20200101-000000").mkdir()
    line = set_aside(run_dir, 0, None)
    [previous] = set(run_dir.glob("previous-*")) - {run_dir / "previous-20200101-000000"}
    moved = "checkpoints, config.yaml, metrics.jsonl, samples.txt"
    assert line == f"moved {moved} into {previous} (the run this one replaces)"
    left = {".run.lock", ".run.lock.json", previous.name, "previous-20200101-000000"}
    assert {p.name for p in run_dir.iterdir()} == left
    assert (previous / "checkpoints/step-00000002/manifest.json").is_file()
    assert (previous / "metrics.jsonl").read_text() == "metrics.jsonl"
    assert set_aside(run_dir, 0, None) is None  # nothing of a run left: an empty folder starts as it is


def test_a_fresh_start_leaves_its_own_data_dir_inside_the_folder_where_it_is(tmp_path):
    """--resume never moved a --data-dir kept inside --out-dir with the old run, then stopped reading it."""
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 2)
    (run_dir / "corpora" / "books").mkdir(parents=True)
    (run_dir / "corpora" / "books" / "manifest.json").write_text("{}")
    line = set_aside(run_dir, 0, None, run_dir / "corpora" / "books")
    [previous] = run_dir.glob("previous-*")
    assert line == f"moved checkpoints into {previous} (the run this one replaces)"
    assert (run_dir / "corpora" / "books" / "manifest.json").is_file()


def test_a_resume_sets_aside_later_checkpoints_and_drops_later_metrics_rows(tmp_path):
    """Resumed from step 4 while steps up to 8 were logged (and a row cut by a kill): rows 5.. go, step 6's
    checkpoint (resumed past, or damaged) moves aside, so neither auto-resume nor pruning can prefer it, and the
    metrics file as it was goes with it (the rows of its steps were deleted, a finished run's final val loss among
    them where an earlier checkpoint was resumed)."""
    run_dir = tmp_path / "run"
    for step in (2, 4, 6):
        fake_checkpoint(run_dir, step)
    rows = [{"step": s, "train_loss": 10.0 - s} for s in range(1, 9)] + [{"step": 4, "val_loss": 5.0}]
    before = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "tr'
    (run_dir / "metrics.jsonl").write_text(before)
    line = set_aside(run_dir, 4, run_dir / "checkpoints" / "step-00000004")
    [previous] = run_dir.glob("previous-*")
    assert line == (
        f"moved checkpoints/step-00000006 into {previous} (saved after step 4, where this run continues); dropped "
        f"the 5 rows of {run_dir / 'metrics.jsonl'} after step 4 (logged again now; the file as it was is in "
        f"{previous})"
    )
    kept = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:4] + rows[-1:]
    assert (previous / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert checkpoint_damage(previous / "checkpoints" / "step-00000006") is None  # moved whole


def test_a_resume_keeps_the_sample_of_its_step_and_drops_the_later_ones(tmp_path):
    """samples.txt after a resume from step 4: the samples of steps 2 and 4 stay, 6's goes (the run writes it again).
    Step 4's went too, and was written again only where due under the resuming launch: a finished run extended
    (its last step no longer last) lost it, and a finished run launched again said it dropped a sample each time."""
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 4)
    (run_dir / "samples.txt").write_text("".join(f"{sample_header(s)}text {s}\n" for s in (2, 4, 6)))
    assert sampled(run_dir, 6) and not sampled(run_dir, 5)
    assert set_aside(run_dir, 4, run_dir / "checkpoints" / "step-00000004") == (
        f"dropped the 1 samples of {run_dir / 'samples.txt'} after step 4 (written again as the run gets there)"
    )
    assert (run_dir / "samples.txt").read_text() == f"{sample_header(2)}text 2\n{sample_header(4)}text 4\n"
    assert sampled(run_dir, 4) and not sampled(run_dir, 6)
    assert set_aside(run_dir, 4, run_dir / "checkpoints" / "step-00000004") is None  # launched again: nothing to say


@pytest.mark.parametrize("garble", ["a row that is not JSON", "bytes that are not text"])
def test_a_garbled_metrics_file_is_kept_aside_and_its_readable_rows_go_on(tmp_path, garble):
    """A metrics.jsonl edited or damaged by hand stopped every launch with json's or the decoder's traceback: now the
    file as it was is kept in previous-<time>/, and the new one holds its readable rows up to the step resumed."""
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 4)
    rows = [json.dumps({"step": s, "train_loss": 10.0 - s}) + "\n" for s in range(1, 7)]
    bad = "not json at all}\n" if garble == "a row that is not JSON" else "\udcd6\udcff}\n"
    text = "".join(rows[:2]) + bad + "".join(rows[2:])
    (run_dir / "metrics.jsonl").write_bytes(text.encode("utf-8", "surrogateescape"))
    line = set_aside(run_dir, 4, run_dir / "checkpoints" / "step-00000004")
    [previous] = run_dir.glob("previous-*")
    assert line == (
        f"moved metrics.jsonl into {previous} (saved after step 4, where this run continues; metrics.jsonl holds rows "
        f"that are not JSON, so its readable rows go on in a new one); dropped the 3 rows of "
        f"{run_dir / 'metrics.jsonl'} after step 4 (logged again now)"
    )
    assert (previous / "metrics.jsonl").read_bytes() == text.encode("utf-8", "surrogateescape")  # as it was
    assert (run_dir / "metrics.jsonl").read_text() == "".join(rows[:4])


def test_a_resume_from_another_folders_checkpoint_sets_this_folders_run_aside_whole(tmp_path):
    """--resume PATH of another run, --out-dir a folder holding a run: none of the folder's run (config, metrics
    rows, checkpoints up to the step) is left to mix with the continued one."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    fake_checkpoint(run_dir, 2)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train_loss": 9.0}\n')
    source = fake_checkpoint(other, 4)
    line = set_aside(run_dir, 4, source)
    [previous] = run_dir.glob("previous-*")
    assert line == f"moved checkpoints, metrics.jsonl into {previous} (the run this one replaces)"
    assert {p.name for p in run_dir.iterdir()} == {previous.name}


def test_a_resume_from_another_folders_checkpoint_starts_with_that_runs_metrics_up_to_the_step(tmp_path):
    """--resume STABLE/checkpoints/step-N --out-dir ANNEAL (docs/configuration.md's way to try several anneals): the
    new folder's metrics.jsonl started empty, so its model card named only the anneal's data and license, not the
    books of the steps before. It now starts with the stable run's rows up to the step, as a copy of the folder
    would; the rows after it are the stable run's alone."""
    stable, anneal = tmp_path / "stable", tmp_path / "anneal"
    source = fake_checkpoint(stable, 4)
    launch = {"step": 0, "launch": {"data": {"source": "files:library", "sources": []}}}
    rows = [launch] + [{"step": s, "train_loss": 10.0 - s} for s in range(1, 7)] + [{"step": 4, "val_loss": 5.0}]
    (stable / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "tr')
    anneal.mkdir()
    line = set_aside(anneal, 4, source)
    assert line == f"copied the 6 rows of {stable / 'metrics.jsonl'} up to step 4 (the run this one continues)"
    kept = [json.loads(r) for r in (anneal / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:5] + rows[-1:]
    assert len((stable / "metrics.jsonl").read_text().splitlines()) == len(rows) + 1  # the stable run's, untouched
    # a checkpoint copied out of its run (no checkpoints/ folder above it): its parents are no run, nothing is carried
    loose, elsewhere = tmp_path / "copies" / "step-00000004", tmp_path / "elsewhere"
    shutil.copytree(source, loose)
    shutil.copy2(stable / "metrics.jsonl", loose.parent.parent / "metrics.jsonl")
    elsewhere.mkdir()
    assert set_aside(elsewhere, 4, loose) is None and not (elsewhere / "metrics.jsonl").exists()


def test_outputs_in_the_way_are_those_the_set_aside_leaves(tmp_path):
    """A folder where the run writes a file (samples.txt), a file where it writes a folder (export): named at start-up
    where they stay once set_aside has run (a resume from this folder's checkpoint, or a folder holding no run), not
    where the fresh start moves them aside with the old run."""
    run_dir = tmp_path / "run"
    newest = fake_checkpoint(run_dir, 2)
    (run_dir / "samples.txt").mkdir()
    (run_dir / "export").write_text("a file")
    (run_dir / "loss.png").write_text("a plot: a file, as it should be")
    files, folders = ["samples.txt", "loss.png"], ["export"]
    expected = [
        f"{run_dir / 'samples.txt'} is a folder where this run writes a file",
        f"{run_dir / 'export'} is a file where this run writes a folder",
    ]
    assert outputs_in_the_way(run_dir, 2, newest, None, files, folders) == expected
    assert outputs_in_the_way(run_dir, 0, None, None, files, folders) == []  # afresh: all of it moves aside
    assert outputs_in_the_way(run_dir, 2, newest, None, ["loss.png"], []) == []
    shutil.rmtree(run_dir / "checkpoints")  # no run here: nothing moves, so afresh finds them too
    assert outputs_in_the_way(run_dir, 0, None, None, files, folders) == expected


def test_pruning_keeps_the_newest_and_the_best_and_passes_over_a_damaged_meta(tmp_path):
    run_dir = tmp_path / "run"
    for step, val in ((2, 5.0), (4, 4.0), (6, 4.5), (8, None)):
        meta = fake_checkpoint(run_dir, step) / "meta.json"
        meta.write_text(json.dumps({"step": step} | ({"val_loss": val} if val else {})))
    (checkpoint_dir(run_dir, 2) / "meta.json").write_text('{"step": 2, "val_lo')  # cut by a crash
    assert [p.name for p in prune_checkpoints(run_dir, 1)] == ["step-00000004", "step-00000008"]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000004", "step-00000008"]


def test_pruning_keeps_the_best_of_each_data_a_run_evaluated_on(tmp_path):
    """A run that went on from other data (--on-new-data continue) evaluates on another val split: its losses do not
    compare with the earlier data's, whose lower best would have the new data's best deleted."""
    run_dir = tmp_path / "run"
    for step, val, data in ((2, 3.0, None), (4, 3.5, "a"), (6, 4.0, "b"), (8, 4.5, "b"), (10, None, "b")):
        meta = fake_checkpoint(run_dir, step) / "meta.json"
        meta.write_text(json.dumps({"step": step, "val_loss": val} | ({"data": data} if data else {})))
    kept = ["step-00000002", "step-00000004", "step-00000006", "step-00000010"]
    assert [p.name for p in prune_checkpoints(run_dir, 1)] == kept
    assert [p.name for p in list_checkpoints(run_dir)] == kept


def test_pruning_keeps_the_newest_checkpoint_from_before_a_wsd_decay(tmp_path):
    """Where a longer run of a wsd schedule branches off (training.optim.decay_start): the newest one kept, however
    many newer ones the run saved since, and the others pruned as usual."""
    run_dir = tmp_path / "run"
    for step, before in ((3, True), (4, False), (7, True), (8, False), (10, False)):
        meta = fake_checkpoint(run_dir, step) / "meta.json"
        meta.write_text(json.dumps({"step": step, "val_loss": None, "before_decay": before}))
    assert before_decay_checkpoint(run_dir) == checkpoint_dir(run_dir, 7)
    assert [p.name for p in prune_checkpoints(run_dir, 1)] == ["step-00000007", "step-00000010"]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000007", "step-00000010"]
    assert is_before_decay(checkpoint_dir(run_dir, 7)) and not is_before_decay(checkpoint_dir(run_dir, 10))


@pytest.mark.slow  # forks the process that prunes, to kill it mid-delete
def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint_under_its_name(tmp_path):
    """A run killed while its save pruned an old checkpoint left that step-N/ with part of its files: a checkpoint
    by its name, that --resume auto (past a damaged newer one) or --resume PATH took up and failed on."""
    run_dir = tmp_path / "run"
    old = fake_checkpoint(run_dir, 2)
    for i in range(2000):  # enough files that deleting them takes longer than a look at the folder
        (old / "sub" / f"{i}.distcp").write_bytes(b"x")
    newest = fake_checkpoint(run_dir, 4)

    def files_left() -> int:
        with contextlib.suppress(FileNotFoundError):  # renamed, or deleted
            return len(os.listdir(old / "sub"))
        return 0

    pruner = multiprocessing.get_context("fork").Process(target=prune_checkpoints, args=(run_dir, 1))
    pruner.start()
    while pruner.is_alive() and files_left() > 2000:  # until deleting has begun
        pass
    os.kill(pruner.pid, signal.SIGKILL)
    pruner.join()
    assert list_checkpoints(run_dir) == [newest]
    assert plan_resume(config(run_dir)) == (newest, [])
    clear_partial(run_dir)  # what the next start or save does
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [newest.name]


def test_checkpoints_past_step_99999999_are_resumed_and_pruned_in_step_order(tmp_path):
    """step-100000000 has nine digits: no step-NNNNNNNN name matched it, so a run that long never resumed from (or
    pruned) its newest checkpoints, and those sorted as text before step-99999998."""
    run_dir = tmp_path / "run"
    older, newest = fake_checkpoint(run_dir, 99_999_998), fake_checkpoint(run_dir, 100_000_000)
    assert newest.name == "step-100000000"
    assert list_checkpoints(run_dir) == [older, newest]
    assert plan_resume(config(run_dir))[0] == newest
    assert prune_checkpoints(run_dir, 1) == [newest] and not older.exists()


def launched_rank(
    folder: Path, rank: int, line: str | None, monkeypatch, capsys, torchrun_layout: bool = True
) -> ProcessFailure:
    """What torchrun's agent reads back from one failed rank whose run reported `line` (None: it crashed). In
    torchrun's layout of error files the first rank to report prints; in another, rank 0."""
    error_file = folder / "attempt_0" / str(rank) / "error.json" if torchrun_layout else folder / f"error_{rank}.json"
    first = not any(folder.glob("attempt_0/*/error.json")) if torchrun_layout else rank == 0
    error_file.parent.mkdir(parents=True, exist_ok=True)
    if line:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        report_error(line)
    printed = capsys.readouterr().err
    assert printed == (f"{line}\n" if line and first else "")  # printed once
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(error_file))


def test_the_launcher_prints_the_root_cause_only_when_no_rank_did(tmp_path, monkeypatch, capsys):
    both = {r: launched_rank(tmp_path / "both", r, "error: lr must be > 0", monkeypatch, capsys) for r in (1, 0)}
    assert _root_cause_line(ChildFailedError("train_accel.py", both)) is None  # printed by rank 1, the first
    # error files laid out otherwise: rank 0 prints, and it did not fail
    full = "error: disk full on rank 1"
    other = {1: launched_rank(tmp_path / "other", 1, full, monkeypatch, capsys, torchrun_layout=False)}
    assert _root_cause_line(ChildFailedError("train_accel.py", other)) == full
    # a rank's own error line wins over a peer's crash in the same second (a lost connection as it exited)
    lost = tmp_path / "mixed" / "error_0.json"
    lost.parent.mkdir()
    message = {"message": "RuntimeError: Connection closed by peer", "extraInfo": {"timestamp": "0"}}
    lost.write_text(json.dumps({"message": message}))  # as torchelastic's record decorator writes it
    mixed = {0: ProcessFailure(local_rank=0, pid=1000, exitcode=1, error_file=str(lost))}
    oom = "error: out of memory at micro-batch 64"
    mixed[3] = launched_rank(tmp_path / "mixed", 3, oom, monkeypatch, capsys, torchrun_layout=False)
    mixed[3].timestamp = mixed[0].timestamp = 0
    assert _root_cause_line(ChildFailedError("train_accel.py", mixed)) == oom
    # a rank the kernel's out-of-memory killer took printed nothing; rank 0 said it lost its connection, the effect
    gone = "error: lost the connection to another process of this run (Connection reset by peer): ..."
    killed = {0: launched_rank(tmp_path / "killed", 0, gone, monkeypatch, capsys)}
    killed[1] = ProcessFailure(local_rank=1, pid=1001, exitcode=-9, error_file=str(tmp_path / "killed" / "none.json"))
    killed[1].timestamp = killed[0].timestamp
    assert _root_cause_line(ChildFailedError("train_accel.py", killed)) == (
        "error: rank 1 was killed by SIGKILL and printed nothing (the kernel's out-of-memory killer sends SIGKILL: "
        "see `dmesg`); the same command continues from the newest checkpoint"
    )
    # one torchrun killed after the rank that failed first, as it hung in a collective with it: that rank's line stands
    killed[1].timestamp, killed[0].timestamp = 30, 0
    assert _root_cause_line(ChildFailedError("train_accel.py", killed)) is None
    # one torchrun stopped in the same second, still importing (no handler yet): that rank's line stands too
    killed[1].exitcode, killed[1].timestamp = -15, 0
    assert _root_cause_line(ChildFailedError("train_accel.py", killed)) is None
    crashed = {0: launched_rank(tmp_path / "crashed", 0, None, monkeypatch, capsys)}
    assert _root_cause_line(ChildFailedError("train_accel.py", crashed)) == (
        "error: rank 0 ended with exit status 1 (To enable traceback see: "
        "https://pytorch.org/docs/stable/elastic/errors.html); its output above says why"
    )
