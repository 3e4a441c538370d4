"""Model card rendering and push_to_hub up to the network boundary (offline here: a clean error, nothing lost)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml
from huggingface_hub import ModelCard, constants
from huggingface_hub.utils import filter_repo_objects
from transformers import GPT2Config

from data_prep.prepare import prepare
from data_prep.tokenizer import gpt2_vocab_and_merges
from modeling.config import get_preset
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from modeling.runs import checkpoint_dir
from testkit import REPO, TINY_MODEL, hub_endpoint, whoami, write_checkpoint, write_pg19_copy
from training.config import TrainConfig, config_to_yaml
from training.export import main as export_main
from training.hub import (
    HubError,
    check_model_card,
    check_push,
    checkpoint_patterns,
    main,
    push,
    render_model_card,
    shown_source,
    write_model_card,
)
from training.metrics import LAUNCH_KEYS, JSONLTracker

# metrics.jsonl's row of a launch from step 0 (training.metrics.LAUNCH_KEYS)
CPU_LAUNCH = {"world_size": 1, "device": "CPU: Xeon", "mixed_precision": "bf16", "dynamo_backend": "NO"}


@pytest.fixture
def finished_run(tmp_path, prepared_books):
    """A run folder as train_accel.py leaves it: config.yaml, metrics.jsonl, export/."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = TrainConfig(
        preset="tiny-cpu", data_dir=str(prepared_books), total_batch_tokens=1024, max_steps=2, warmup_steps=1
    )
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    rows = [
        {"step": 0, "launch": CPU_LAUNCH},
        {"step": 0, "val_loss": 10.9},
        {"step": 1, "train_loss": 10.5, "tokens_per_sec": 900.0, "tokens_seen": 1024},
        {"step": 2, "train_loss": 9.25, "tokens_per_sec": 1100.0, "tokens_seen": 2048},
        {"step": 2, "val_loss": 9.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    export_hf(GPT(get_preset("tiny-cpu")), run / "export", gpt2_vocab_and_merges())
    return run


def test_model_card_reports_the_run(finished_run, prepared_books):
    card = render_model_card(finished_run)
    front_matter = yaml.safe_load(card.split("---")[1])
    assert front_matter["library_name"] == "transformers" and front_matter["pipeline_tag"] == "text-generation"
    manifest = json.loads((prepared_books / "manifest.json").read_text())
    assert f"{manifest['splits']['train']['num_tokens']:,} tokens" in card
    assert f"3 train documents ({manifest['splits']['train']['num_tokens']:,} tokens), 1 val document (" in card
    epochs = 2048 / manifest["splits"]["train"]["num_tokens"]  # the passes over the train split: past 4 it memorizes
    assert (
        "| optimizer steps | 2 |" in card
        and f"| tokens seen | 2,048 ({epochs:.2g} epochs of the train split) |" in card
    )
    assert "| hardware | 1 × CPU: Xeon, bf16 mixed precision |" in card
    assert "| final train loss | 9.2500 |" in card
    assert "| val loss (final / best) | 9.5000 / 9.5000 |" in card
    assert "| throughput (median) | 1,000 tokens/s |" in card


def write_run(run, data_dir, rows, **config) -> TrainConfig:
    """config.yaml and metrics.jsonl as a finished run leaves them."""
    run.mkdir(exist_ok=True)
    fields = {"max_steps": 2, "total_batch_tokens": 1024, **config}
    cfg = TrainConfig(preset="tiny-cpu", data_dir=str(data_dir), **fields)
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cfg


ROWS = [{"step": 2, "train_loss": 9.25, "tokens_per_sec": 1000.0, "tokens_seen": 2048}]
# the prepared_books fixture's source row: a reader is told what `default` is, and that it is not a Hub dataset
DEFAULT_ROW = (
    "| `default:hamlet,macbeth,tempest,twelfth_night`: Project Gutenberg's texts of Shakespeare and Milton | "
    "not on the Hub | public domain in the USA |"
)


@pytest.mark.parametrize(
    ("config", "optimizer", "schedule"),
    [
        (
            {"optimizer": "muon", "muon_lr": 0.03, "muon_momentum": 0.9, "lr": 6e-3, "lr_schedule": "wsd",
             "warmup_steps": 6, "decay_fraction": 0.25, "min_lr_ratio": 0.0},
            "| optimizer | Muon lr 0.03 (momentum 0.9) on the blocks' matrices; AdamW lr 0.006 (betas 0.9/0.95, "
            "weight decay 0.1) on embeddings, LayerNorms and biases |",
            "| lr schedule | wsd: 6 warmup steps, constant, then linear decay over the last 0.25 of the steps to 0× "
            "the peak |",
        ),
        (  # the stable part of a run, to anneal later: no decay (it said a decay over the last 0 of the steps)
            {"optimizer": "muon", "muon_lr": 0.02, "muon_momentum": 0.95, "lr": 3e-3, "lr_schedule": "wsd",
             "warmup_steps": 2, "decay_fraction": 0.0, "min_lr_ratio": 0.1},
            "| optimizer | Muon lr 0.02 (momentum 0.95) on the blocks' matrices; AdamW lr 0.003",
            "| lr schedule | wsd with no decay: 2 warmup steps, then the peak lr to the last step (the stable part "
            "of a run) |",
        ),
        (  # an anneal: the decay given in steps
            {"optimizer": "muon", "muon_lr": 0.02, "muon_momentum": 0.95, "lr": 3e-3, "lr_schedule": "wsd",
             "warmup_steps": 2, "decay_fraction": 0.2, "decay_steps": 2, "min_lr_ratio": 0.1},
            "| optimizer | Muon lr 0.02 (momentum 0.95) on the blocks' matrices; AdamW lr 0.003",
            "| lr schedule | wsd: 2 warmup steps, constant, then linear decay over the last 2 steps to 0.1× the peak |",
        ),
        (
            {"optimizer": "adamw", "lr": 3e-4, "lr_schedule": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1},
            "| optimizer | AdamW lr 0.0003 (betas 0.9/0.95, weight decay 0.1) |",
            "| lr schedule | cosine: 10 warmup steps, then cosine decay to 0.1× the peak |",
        ),
        (  # one warmup step, a decay of one step: it said "1 warmup steps", "the last 1 steps"
            {"optimizer": "adamw", "lr": 3e-4, "lr_schedule": "wsd", "warmup_steps": 1, "decay_steps": 1},
            "| optimizer | AdamW lr 0.0003 (betas 0.9/0.95, weight decay 0.1) |",
            "| lr schedule | wsd: 1 warmup step, constant, then linear decay over the last 1 step to 0.1× the peak |",
        ),
    ],
)  # fmt: skip
def test_model_card_says_the_optimizers_lrs_and_schedule_of_the_run(
    tmp_path, prepared_books, config, optimizer, schedule
):
    write_run(tmp_path / "run", prepared_books, ROWS, **{"max_steps": 20, **config})  # past the warmup: no note
    card = render_model_card(tmp_path / "run")
    assert optimizer in card and schedule in card


def test_the_card_says_where_the_warmup_was_as_long_as_the_run(tmp_path, prepared_books):
    """A run whose warmup outlasted its steps (its start-up warned) got a card giving the schedule's peak and decay as
    if they had come; the card now gives the highest lr it trained at. One stopped early inside a longer plan's warmup
    is the steps row's "stopped early" instead."""
    write_run(tmp_path / "run", prepared_books, ROWS, warmup_steps=3)
    assert (
        "| lr schedule | wsd: 3 warmup steps, constant, then linear decay over the last 0.2 of the steps to 0.1× the "
        "peak; the run's 2 steps were all warmup: the lr reached 0.67× the peak at most |"
    ) in render_model_card(tmp_path / "run")
    # launched again with fewer steps (nothing to train), its launch row's plan is not the run's
    again = [*ROWS, {"step": 2, "launch": CPU_LAUNCH | {"planned_steps": 1}}]
    write_run(tmp_path / "run", prepared_books, again, warmup_steps=3)
    assert "; the run's 2 steps were all warmup: the lr reached 0.67× the peak at most |" in render_model_card(
        tmp_path / "run"
    )
    write_run(tmp_path / "run", prepared_books, ROWS, warmup_steps=1)
    assert "over the last 0.2 of the steps to 0.1× the peak |" in render_model_card(tmp_path / "run")
    # a decay given in steps, more of them than the default max_steps: the schedule is the run's own (the run config
    # the card builds for it has its steps, not the default's, which a decay this long is refused against)
    write_run(tmp_path / "run", prepared_books, ROWS, warmup_steps=300, max_steps=250, decay_steps=210)
    assert "; the run's 250 steps were all warmup: the lr reached 0.51× the peak at most |" in render_model_card(
        tmp_path / "run"
    )
    write_run(tmp_path / "run", prepared_books, ROWS, warmup_steps=5, max_steps=6)
    card = render_model_card(tmp_path / "run")
    assert "to 0.1× the peak |" in card and "| optimizer steps | 2 of 6 planned (stopped early:" in card, card


def test_model_card_data_license_and_dataset_are_the_manifests(tmp_path, prepared_books, monkeypatch):
    """Public domain only where the source says so; a Hub dataset (PG-19, even from a local copy) in `datasets:`."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    pg19 = tmp_path / "pg19-data"
    prepare(f"pg19:{write_pg19_copy(tmp_path / 'pg19')}", pg19)
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("A book of unknown provenance.\n" * 20)
    (books / "b.txt").write_text("Another one.\n" * 20)
    mine = tmp_path / "mine"
    prepare(f"files:{books}", mine)

    cards = {}
    for name, data_dir in (("default", prepared_books), ("pg19", pg19), ("files", mine)):
        write_run(tmp_path / name, data_dir, ROWS)
        cards[name] = ModelCard(render_model_card(tmp_path / name))
    assert cards["default"].data.datasets is None
    assert DEFAULT_ROW in cards["default"].text
    assert "The books are in the public domain in the USA." in cards["default"].text
    assert cards["pg19"].data.datasets == ["emozilla/pg19"]
    assert "| [emozilla/pg19](https://huggingface.co/datasets/emozilla/pg19) | apache-2.0 |" in cards["pg19"].text
    assert "5 train documents" in cards["pg19"].text and "3 val documents" in cards["pg19"].text
    assert "public domain" not in cards["pg19"].text and "public domain" not in cards["files"].text
    # a local folder by its name: where it lay on the machine that trained is no business of the card's readers
    assert "| `files:books` | not on the Hub | unknown |" in cards["files"].text
    assert str(tmp_path) not in str(cards["files"])
    assert "| `pg19:pg19` | [emozilla/pg19]" in cards["pg19"].text and str(tmp_path) not in str(cards["pg19"])
    assert "The license of some of this data is unknown" in cards["files"].text
    assert [card.data.license for card in cards.values()] == ["mit", "mit", "unknown"]  # bookgpt's, unless the data's
    # is unknown: the metadata said mit above the text's "unknown"


@pytest.mark.parametrize(
    ("source", "dataset", "shown"),
    [
        ("files:/home/me/library", None, "files:library"),
        ("files:~/books/*.txt", None, "files:books/*.txt"),
        ("files:/srv/lib/**/*.txt", None, "files:lib/**/*.txt"),  # it said files:**/*.txt
        ("files:/srv/*/books/*.txt", None, "files:srv/*/books/*.txt"),
        ("files:*.txt", None, "files:*.txt"),
        ("hf:/data/shelf/books.parquet:train:body", None, "hf:books.parquet:train:body"),
        ("pg19:/home/me/pg19", "emozilla/pg19", "pg19:pg19"),  # the card names its Hub dataset beside it
        ("pg19", "emozilla/pg19", "pg19"),
        ("hf:someone/books:train", "someone/books", "hf:someone/books:train"),
        ("default+files:/srv/extra/", None, "default+files:extra"),
        ("gutenberg:145,2701", None, "gutenberg:145,2701"),
    ],
)
def test_a_card_names_a_local_source_by_its_folder_not_its_path(source, dataset, shown):
    assert shown_source(source, dataset) == shown


def test_a_card_rendered_from_inside_the_run_folder_names_the_run(finished_run, monkeypatch):
    """`python -m training.hub . --repo-id ...` from inside the run folder titled the card "# : a tiny-cpu GPT" and
    gave the model-index an empty name."""
    monkeypatch.chdir(finished_run)
    card = ModelCard(render_model_card("."))
    assert card.text.lstrip().startswith("# run: a tiny-cpu GPT trained with bookgpt")
    assert card.data.model_name == "run"


def test_model_card_eval_results_are_the_runs_last_evals(tmp_path, prepared_books):
    rows = [
        {"step": 0, "launch": CPU_LAUNCH},
        {"step": 0, "val_loss": 10.9},
        *ROWS,
        {
            "step": 2,
            "val_loss": 9.51234,
            "hellaswag_acc_norm": 0.3125,
            "hellaswag_acc": 0.25,
            "lambada_acc": 0.125,
            "lambada_ppl": 812.5,
        },
    ]
    write_run(tmp_path / "run", prepared_books, rows, eval_tasks="hellaswag,lambada", eval_limit=16)
    card = ModelCard(render_model_card(tmp_path / "run"))
    results = {(r.dataset_type, r.metric_type): r for r in card.data.eval_results}
    assert set(results) == {
        ("default:hamlet,macbeth,tempest,twelfth_night", "loss"), ("Rowan/hellaswag", "acc_norm"),
        ("Rowan/hellaswag", "accuracy"), ("EleutherAI/lambada_openai", "accuracy"),
        ("EleutherAI/lambada_openai", "perplexity"),
    }  # fmt: skip
    # per token: it said "last-word perplexity", which lm-eval-harness's figure per word is, higher than ours
    ppl = results["EleutherAI/lambada_openai", "perplexity"]
    assert ppl.metric_value == 812.5 and ppl.metric_name == "last-word perplexity per token, zero-shot"
    assert results["default:hamlet,macbeth,tempest,twelfth_night", "loss"].metric_value == 9.5123
    assert results["Rowan/hellaswag", "acc_norm"].metric_value == 0.3125
    assert results["Rowan/hellaswag", "acc_norm"].dataset_args == {"limit": 16}  # a subset, and it says so
    # the text too: it gave "hellaswag acc norm (final) | 0.3125", a figure on 16 examples read as the whole task's
    assert "| hellaswag acc norm (final, first 16 examples) | 0.3125 |" in card.text
    assert "| lambada acc (final, first 16 examples) | 0.1250 |" in card.text
    check_model_card(yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()))  # the start-up check passes


def test_the_card_says_where_each_launch_of_a_resumed_run_trained(finished_run):
    """A run resumed on other hardware (after losing a node, say): each launch's steps, where a resume changed them.
    A launch that found the run finished trained nothing, and is not on the card."""
    gpu = {"world_size": 8, "device": "NVIDIA H100 80GB HBM3", "mixed_precision": "bf16", "dynamo_backend": "INDUCTOR"}
    rows = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    rows += [{"step": 1, "launch": gpu}, {"step": 1, "launch": {**gpu, "world_size": 4}}]  # the first ended at once
    rows += [{"step": 2, "launch": gpu}, {"step": 4, "train_loss": 8.0, "tokens_seen": 4096}]
    rows += [{"step": 4, "launch": {**gpu, "world_size": 4}}]  # the finished run launched again: nothing trained
    (finished_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        "| hardware | step 1: 1 × CPU: Xeon, bf16 mixed precision; step 2: 4 × NVIDIA H100 80GB HBM3, bf16 "
        "mixed precision, torch.compile; steps 3-4: 8 × NVIDIA H100 80GB HBM3, bf16 mixed precision, torch.compile |"
    ) in render_model_card(finished_run)


@pytest.mark.parametrize(
    ("config", "rows", "steps"),
    [
        ({}, [], "| optimizer steps | 1 of 2 planned (stopped early: the lr schedule above did not run to its end) |"),
        ({"max_tokens": 4096}, [], "| optimizer steps | 1 of 4 planned (stopped early: the lr schedule above did not "),
        # resumed with half the batch after a step of 1,024 tokens: its launch planned 6 more (the config alone, 8)
        ({"max_tokens": 4096, "total_batch_tokens": 512},
         [{"step": 1, "launch": CPU_LAUNCH | {"planned_steps": 7}}, {"step": 2, "train_loss": 9, "tokens_seen": 1536}],
         "| optimizer steps | 2 of 7 planned (stopped early"),
        # a launch that trained no step planned none of them: the finished run launched again with more steps (killed
        # before its first) or fewer (nothing to train)
        ({"max_steps": 1}, [{"step": 1, "launch": CPU_LAUNCH | {"planned_steps": n}} for n in (5, 0)],
         "| optimizer steps | 1 |"),
        # under a time budget, the count it decided (max_steps is its cap)
        ({"max_steps": 100, "time_budget_minutes": 1.0}, [{"step": 1, "total_steps": 3}], "| 1 of 3 planned (stopped"),
        # ... and one that ran to the count it decided says the budget set it (make train's: 5 minutes, 600 at most)
        ({"max_steps": 600, "time_budget_minutes": 5.0}, [{"step": 1, "total_steps": 1}],
         "| optimizer steps | 1 (the count a 5-minute time budget set, 600 at most) |"),
        ({"max_tokens": 4096, "time_budget_minutes": 5.0}, [{"step": 1, "total_steps": 1}],
         "| optimizer steps | 1 (the count a 5-minute time budget set, 4,096 tokens at most) |"),
        ({"max_steps": 1}, [], "| optimizer steps | 1 |"),  # a finished run
        # a time-budget run went on with the budget off (--time-budget-minutes 0 --max-steps 4): max_steps decides
        ({"max_steps": 4}, [{"step": 1, "total_steps": 1}], "| optimizer steps | 1 of 4 planned (stopped early"),
    ],
)  # fmt: skip
def test_the_card_of_a_run_stopped_early_says_so(tmp_path, prepared_books, config, rows, steps):
    """A run stopped by a signal at step 1 of 2 and exported (python -m training.export RUN --out RUN/export, as
    the push advises): its card gave the schedule of the whole run, with no word that it never ran to its end."""
    write_run(tmp_path / "run", prepared_books, [{"step": 1, "train_loss": 9.25, "tokens_seen": 1024}, *rows], **config)
    assert steps in render_model_card(tmp_path / "run")


def test_the_card_says_where_a_resume_took_the_lr_back_up_after_its_decay(finished_run):
    """A finished run trained longer from its decayed checkpoint (after rewarm_warning): its schedule row was the
    last launch's plan, as if the lr had decayed once. The launch row keeps the jump; a launch without one adds
    nothing."""
    tracker = JSONLTracker(finished_run)
    values = {k: CPU_LAUNCH.get(k, 4) for k in LAUNCH_KEYS} | {"data_path": str(finished_run), "start_step": 2}
    tracker.store_init_configuration(values | {"rewarmed_from": 0.1, "rewarmed_to": 0.9876})
    tracker.log({"train_loss": 8.0, "tokens_per_sec": 1000.0, "tokens_seen": 3072}, step=3)
    tracker.store_init_configuration(values | {"start_step": 3})  # resumed again, on its new plan
    tracker.log({"train_loss": 7.5, "tokens_per_sec": 1000.0, "tokens_seen": 4096}, step=4)
    card = render_model_card(finished_run)
    assert (
        "to 0.1× the peak; from step 3 the lr went back up from 0.10× to 0.99× the peak (a resume trained the "
        "decayed run longer) |\n| optimizer steps | 4 |"
    ) in card, card


def test_the_card_gives_the_recipe_of_each_span_of_steps_a_resume_changed(finished_run, prepared_books):
    """A run resumed after a loss spike with half the lrs and twice the batch: its card gave the last launch's lrs and
    batch (config.yaml's) as the whole run's. Each launch row keeps its recipe; what no resume changed (the schedule
    here) stays one text."""
    first = TrainConfig(
        preset="tiny-cpu", data_dir=str(prepared_books), total_batch_tokens=1024, max_steps=2, warmup_steps=1
    )
    then = dataclasses.replace(first, lr=3e-4, muon_lr=0.01, total_batch_tokens=2048, max_steps=3)
    (finished_run / "config.yaml").write_text(config_to_yaml(then))
    (finished_run / "metrics.jsonl").write_text("")
    tracker = JSONLTracker(finished_run)
    for cfg, start, steps in ((first, 0, (1, 2)), (then, 2, (3,))):
        run_info = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None}  # as init_trackers passes it
        run_info |= {"data_path": str(prepared_books), "start_step": start, "planned_steps": 3}
        tracker.store_init_configuration(run_info | {k: CPU_LAUNCH.get(k, 8) for k in LAUNCH_KEYS if k not in run_info})
        for step in steps:
            tracker.log({"train_loss": 9.0, "tokens_per_sec": 1000.0, "tokens_seen": 1024 * step}, step=step)
    card = render_model_card(finished_run)
    assert (
        "| optimizer | steps 1-2: Muon lr 0.02 (momentum 0.95) on the blocks' matrices; AdamW lr 0.0006 (betas "
        "0.9/0.95, weight decay 0.1) on embeddings, LayerNorms and biases; step 3: Muon lr 0.01 (momentum 0.95) on "
        "the blocks' matrices; AdamW lr 0.0003 (betas 0.9/0.95, weight decay 0.1) on embeddings, LayerNorms and "
        "biases |\n| lr schedule | wsd: 1 warmup step, constant, then linear decay over the last 0.2 of the steps to "
        "0.1× the peak |"
    ) in card, card
    batch = "| batch | steps 1-2: 1,024 tokens/step, micro-batch 16; step 3: 2,048 tokens/step, micro-batch 16 |"
    assert batch in card and "| optimizer steps | 3 |" in card, card


def test_the_card_gives_the_throughput_of_each_span_of_hardware(finished_run):
    """A run resumed on 8 GPUs after 2 steps on a CPU: the card gave the median over both, 250,550 tokens/s, which no
    launch of the run trained at. A launch on the same hardware as the one before it is of its span."""
    gpu = {"world_size": 8, "device": "NVIDIA H100 80GB HBM3", "mixed_precision": "bf16", "dynamo_backend": "NO"}
    rows = [
        {"step": 2, "launch": gpu}, {"step": 3, "train_loss": 8.0, "tokens_per_sec": 5e5, "tokens_seen": 3072},
        {"step": 3, "launch": gpu}, {"step": 4, "train_loss": 7.0, "tokens_per_sec": 7e5, "tokens_seen": 4096},
    ]  # fmt: skip
    with (finished_run / "metrics.jsonl").open("a") as metrics:
        metrics.write("".join(json.dumps(r) + "\n" for r in rows))
    card = render_model_card(finished_run)
    assert "| throughput (median) | steps 1-2: 1,000 tokens/s; steps 3-4: 600,000 tokens/s |" in card


@pytest.mark.parametrize("start", ["hub", "export", "folder"])
def test_the_card_names_the_model_a_run_started_from_not_a_path(tmp_path, prepared_books, start):
    """--init-from a Hub id is the card's base_model; a local export is named by its own card's model name (its
    run's), a folder without a card by its name: the path on the training machine is nowhere on the card."""
    parent = tmp_path / "machine-path" / ("export" if start == "export" else "parent-weights")
    parent.mkdir(parents=True)
    if start == "export":
        (parent / "README.md").write_text("---\nmodel_name: parent-run\nlicense: mit\n---\n# parent-run\n")
    init_from = "openai-community/gpt2" if start == "hub" else str(parent)
    write_run(tmp_path / "run", prepared_books, ROWS, init_from=init_from)
    card = render_model_card(tmp_path / "run")
    name = {"hub": "openai-community/gpt2", "export": "parent-run", "folder": "parent-weights"}[start]
    assert f"| model | {name} (continued)" in card and "machine-path" not in card, card
    local = " (a local model)" * (start != "hub")
    assert f"pretrained from the weights of {name}{local} with bookgpt" in card.replace("\n", " "), card
    front_matter = yaml.safe_load(card.split("---")[1])
    assert front_matter.get("base_model") == ("openai-community/gpt2" if start == "hub" else None)


def test_the_card_says_the_micro_batch_of_each_launch(finished_run):
    """Resumed on fewer processes, a run keeps its tokens per step with a larger micro-batch (or auto picks
    another): the batch row says each span's, not only the last launch's (config.yaml's)."""
    rows = [{"step": 0, "launch": {**CPU_LAUNCH, "micro_batch_size": 8}}, {"step": 1, "train_loss": 10.0}]
    rows += [{"step": 1, "launch": {**CPU_LAUNCH, "micro_batch_size": 8}}, {"step": 2, "train_loss": 9.0}]
    rows += [{"step": 2, "launch": {**CPU_LAUNCH, "micro_batch_size": 16}}]
    rows += [{"step": 4, "train_loss": 8.0, "tokens_seen": 4096}]
    (finished_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = render_model_card(finished_run)
    assert "| batch | 1,024 tokens/step, steps 1-2: micro-batch 8; steps 3-4: micro-batch 16 |" in card, card
    assert "| hardware | 1 × CPU: Xeon, bf16 mixed precision |" in card  # the same hardware throughout: one span


@pytest.mark.parametrize(
    ("windows", "said"),
    [
        ([(1, None), (100, 30.0), (200, 30.0)], "1 h 40 min"),  # the first step's row untimed: 100 + 100 steps x 30 s
        ([(2, 0.25), (4, 0.5)], "2 s"),  # 2 x 0.25 + 2 x 0.5 s
        ([(2, 29.85)], "1 min"),  # 59.7 s, rounded once: not "60 s"
        ([(1, None)], None),  # one step, timed with the compile: nothing to say
    ],
)
def test_the_card_says_the_time_spent_in_train_steps(tmp_path, prepared_books, windows, said):
    rows = [
        {"step": s, "train_loss": 9.0, "tokens_seen": 1024 * s} | ({"step_time_s": t} if t else {}) for s, t in windows
    ]
    write_run(tmp_path / "run", prepared_books, rows)
    lines = [line for line in render_model_card(tmp_path / "run").splitlines() if "time in train steps" in line]
    assert lines == (
        [f"| time in train steps | {said} (start-up, compile, evals and checkpoints not counted) |"] if said else []
    )


def test_the_card_finds_the_data_from_any_working_folder(finished_run, prepared_books):
    """A run trained on a relative --data-dir, its card rendered from another folder (python -m training.hub):
    the manifest is where the launch found it."""
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    (finished_run / "config.yaml").write_text(yaml.safe_dump({**config, "data_dir": "data/books"}))
    assert "`data/books` (no manifest.json there: source and license unknown)" in render_model_card(finished_run)
    with (finished_run / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 0, "launch": {**CPU_LAUNCH, "data_path": str(prepared_books)}}) + "\n")
    manifest = json.loads((prepared_books / "manifest.json").read_text())
    assert f"{manifest['splits']['train']['num_tokens']:,} tokens" in render_model_card(finished_run)


def test_the_card_describes_the_data_trained_on_after_its_folder_is_gone(finished_run, prepared_books, tmp_path):
    """The card is written at the end, or later by `python -m training.hub`: the data folder may be gone by then
    (scratch storage wiped) or prepared anew. The launch row, written by the tracker as a launch does, keeps what the
    card says of the data."""
    data = tmp_path / "scratch" / "books"
    shutil.copytree(prepared_books, data)
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    (finished_run / "config.yaml").write_text(yaml.safe_dump({**config, "data_dir": str(data)}))
    values = {k: CPU_LAUNCH.get(k, 8) for k in LAUNCH_KEYS} | {"data_path": str(data), "start_step": 0}
    (finished_run / "metrics.jsonl").write_text("")
    tracker = JSONLTracker(finished_run)
    tracker.store_init_configuration(values)
    tracker.log({"train_loss": 9.25, "tokens_per_sec": 1100.0, "tokens_seen": 2048}, step=2)
    tracker.log({"val_loss": 9.5}, step=2)
    manifest = json.loads((data / "manifest.json").read_text())
    before = render_model_card(finished_run)
    shutil.rmtree(data)
    assert render_model_card(finished_run) == before  # not "no manifest.json there: source and license unknown"
    tokens, license = manifest["splits"]["train"]["num_tokens"], manifest["sources"][0]["license"]
    assert f"({tokens:,} tokens)" in before and f"| {license} |" in before


def test_a_run_that_went_on_from_other_data_names_every_source_and_license(finished_run, prepared_books, tmp_path):
    """Trained on a folder of books of unknown license, then (--on-new-data continue) on public-domain books: the
    card named the last data alone, public domain, under the MIT license."""
    library = tmp_path / "library"
    library.mkdir()
    for name in ("a", "b", "c"):
        (library / f"{name}.txt").write_text(f"Book {name}. " + "Some words of a book of mine. " * 400)
    first = tmp_path / "mine"
    prepare(f"files:{library}", first, val_fraction=0.3)
    (finished_run / "metrics.jsonl").write_text("")
    tracker = JSONLTracker(finished_run)
    for data, step, note in ((first, 0, None), (prepared_books, 1, "new data (--on-new-data continue): ...")):
        values = {k: CPU_LAUNCH.get(k, 8) for k in LAUNCH_KEYS} | {"data_path": str(data), "start_step": step}
        tracker.store_init_configuration(values | ({"new_data": note} if note else {}))
        tracker.log({"train_loss": 9.25, "tokens_per_sec": 1100.0, "tokens_seen": 1024 * (step + 1)}, step=step + 1)
        tracker.log({"val_loss": 3.0 if note is None else 4.5}, step=step + 1)
    tracker.log({"val_loss": 4.25}, step=3)
    card = render_model_card(finished_run)
    assert "license: unknown" in card and "| `files:library` | not on the Hub | unknown |" in card
    assert DEFAULT_ROW in card
    assert "From step 2 the run went on from the start of other data" in card
    assert "| tokens seen | 2,048 |" in card  # read of two splits: no one count of epochs
    # the best val loss is the new val split's: the 3.0 was measured on the other data's
    assert "| val loss (final / best) | 4.2500 / 4.2500 |" in card
    # and the metadata names that split's data alone (it named files:library+default:..., the val split of neither)
    results = [(r.dataset_type, r.metric_value) for r in ModelCard(card).data.eval_results if r.metric_type == "loss"]
    assert results == [("default:hamlet,macbeth,tempest,twelfth_night", 4.25)]


def test_the_cards_usage_code_runs_on_a_model_of_a_short_context(finished_run, capsys):
    """The card's snippet asked for 50 new tokens: past a 32-token context (a CPU run's --block-size 32) transformers'
    GPT-2 fails with an IndexError. It now takes the export's generation_config (half the context)."""
    shutil.rmtree(finished_run / "export")
    export_hf(GPT(TINY_MODEL), finished_run / "export", gpt2_vocab_and_merges())
    card = write_model_card(finished_run, str(finished_run / "export")).read_text()
    [code] = re.findall(r"```python\n(.*?)```", card, re.DOTALL)
    exec(code, {})
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_write_model_card_fills_repo_id(finished_run):
    path = write_model_card(finished_run, "someone/tiny-books")
    assert 'from_pretrained("someone/tiny-books")' in path.read_text()


def tree_hashes(folder):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_export_older_than_the_runs_newest_checkpoint_gets_no_card(finished_run):
    """A resumed run that a signal stopped trained on past its earlier end's export: a card would describe steps the
    export's weights never took."""
    write_checkpoint(GPT(TINY_MODEL), checkpoint_dir(finished_run, 3))  # saved after the export
    before = tree_hashes(finished_run)
    with pytest.raises(HubError, match=r"holds the weights of an earlier end of this run, .* on to step-00000003 "):
        write_model_card(finished_run, "someone/tiny-books")
    assert tree_hashes(finished_run) == before


def test_a_copied_run_folder_is_told_apart_from_one_trained_since_by_steps_not_times(finished_run, tmp_path):
    """A run folder copied with cp -r (times set by the copy's order) was refused: its newest checkpoint's time was
    after the export's. The export records its checkpoint's step, which the push compares; one trained on since (a
    later step, whatever its time) is still refused."""
    shutil.rmtree(finished_run / "export")
    write_checkpoint(GPT(get_preset("tiny-cpu")), checkpoint_dir(finished_run, 2))  # the run's shape
    export_main([str(finished_run), "--out", str(finished_run / "export")])
    copy = shutil.copytree(finished_run, tmp_path / "copy")
    later = (copy / "export/config.json").stat().st_mtime + 60
    os.utime(checkpoint_dir(copy, 2), (later, later))  # copied after the export
    assert write_model_card(copy, "someone/tiny-books").is_file()
    write_checkpoint(GPT(TINY_MODEL), checkpoint_dir(copy, 3))  # a resume stopped before its end
    os.utime(checkpoint_dir(copy, 3), (later - 120, later - 120))  # copied before the export
    with pytest.raises(HubError, match=r"holds the weights of an earlier end of this run, .* on to step-00000003 "):
        write_model_card(copy, "someone/tiny-books")


def test_the_card_of_an_export_describes_the_steps_of_its_checkpoint_not_a_resume_killed_since(finished_run):
    """A finished run launched again to train on, killed (kill -9) before its first save: metrics.jsonl logged steps
    the export's weights (those of step-00000002, the newest checkpoint) never took, and config.yaml is the killed
    launch's, with more steps. The card counted those steps, and then called the export stopped early."""
    shutil.rmtree(finished_run / "export")
    write_checkpoint(GPT(TINY_MODEL), checkpoint_dir(finished_run, 2))  # the run's end: its last save, then its export
    shutil.copy2(finished_run / "config.yaml", checkpoint_dir(finished_run, 2) / "config.yaml")  # as every save does
    export_hf(GPT(get_preset("tiny-cpu")), finished_run / "export", gpt2_vocab_and_merges())
    config = yaml.safe_load((finished_run / "config.yaml").read_text())  # the killed launch's: 2 more steps
    (finished_run / "config.yaml").write_text(yaml.safe_dump({**config, "max_steps": 4}))
    gpu = {"world_size": 8, "device": "NVIDIA H100 80GB HBM3", "mixed_precision": "bf16", "dynamo_backend": "NO"}
    killed = [{"step": 2, "launch": gpu}, {"step": 3, "train_loss": 8.0, "tokens_per_sec": 9000.0, "tokens_seen": 3072},
              {"step": 3, "val_loss": 8.5}]  # fmt: skip
    with (finished_run / "metrics.jsonl").open("a") as metrics:
        metrics.write("".join(json.dumps(r) + "\n" for r in killed))
    card = write_model_card(finished_run, "someone/tiny-books").read_text()
    # its checkpoint's config, which the export's steps trained under: the run's end, not 2 of the 4 planned since
    assert "| optimizer steps | 2 |" in card and "| tokens seen | 2,048 (" in card
    assert "| hardware | 1 × CPU: Xeon, bf16 mixed precision |" in card
    assert "| final train loss | 9.2500 |" in card and "| val loss (final / best) | 9.5000 / 9.5000 |" in card
    assert "| throughput (median) | 1,000 tokens/s |" in card


def test_a_run_still_training_is_not_pushed(finished_run, monkeypatch, capsys):
    """A run folder whose run is still training (its lock held, here by a process that took it as a launch does):
    the push wrote a card and uploaded the export of an earlier end (or, before its first end, was told to export a
    checkpoint of the unfinished run). Now one line names the run's holder, before anything is written."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    hold = "import sys, time, pathlib; from training.runlock import lock_run_folder; "
    hold += "held = lock_run_folder(pathlib.Path(sys.argv[1]))"
    holder = subprocess.Popen([sys.executable, "-c", f"{hold}; print(); time.sleep(60)", finished_run], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "\n"  # the lock is held
        before = tree_hashes(finished_run)
        assert main([str(finished_run), "--repo-id", "someone/tiny-books"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: the run in {finished_run} is still training (host ")
        assert f"pid {holder.pid}," in err
        assert "push once it has ended" in err and len(err.splitlines()) == 1
        assert tree_hashes(finished_run) == before
    finally:
        holder.kill()
        holder.wait()


def test_push_without_token_is_a_clear_error(finished_run, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    before = tree_hashes(finished_run)
    assert main([str(finished_run), "--repo-id", "someone/tiny-books"]) == 1
    assert "no Hugging Face token found: run `hf auth login` or set HF_TOKEN, then push" in capsys.readouterr().err
    assert tree_hashes(finished_run) == before  # checked before anything is written


def test_push_of_a_malformed_repo_id_or_no_run_folder_is_a_clear_error_before_anything_is_written(
    finished_run, tmp_path, monkeypatch, capsys
):
    """The repo id was checked by the upload, after the model card was written for it; a missing run folder was
    "holds no transformers export: train with --export-hf true first"."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    before = tree_hashes(finished_run)
    assert main([str(finished_run), "--repo-id", "bad id!!"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: --repo-id 'bad id!!' is not a Hub repository id \(.*\); use you/name\n", err), err
    assert tree_hashes(finished_run) == before
    assert main([str(tmp_path / "nowhere"), "--repo-id", "someone/tiny-books"]) == 1
    assert capsys.readouterr().err == (
        f"error: run folder {tmp_path / 'nowhere'} does not exist; give the folder a run trained in (its out_dir)\n"
    )


@pytest.mark.parametrize("inside", ["export", "checkpoints/step-00000002"])
def test_a_folder_inside_the_run_given_to_the_push_names_the_run_folder(finished_run, monkeypatch, capsys, inside):
    """The run's export/ or a checkpoint given as the run folder was told "RUN/export/export holds no transformers
    export: train the run first"; the line gives the run folder, with this push's flags."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    write_checkpoint(GPT(get_preset("tiny-cpu")), checkpoint_dir(finished_run, 2))
    before = tree_hashes(finished_run)
    assert main([str(finished_run / inside), "--repo-id", "someone/tiny-books", "--private"]) == 1
    assert capsys.readouterr().err == (
        f"error: {finished_run / inside} is inside the run folder {finished_run}, whose config.yaml and metrics.jsonl "
        f"the model card is written from: give the run folder, python -m training.hub {finished_run} --repo-id "
        "someone/tiny-books --private\n"
    )
    assert tree_hashes(finished_run) == before
    monkeypatch.chdir(finished_run / inside)  # "." from inside it: it said "export holds no transformers export"
    assert main([".", "--repo-id", "someone/tiny-books"]) == 1
    assert capsys.readouterr().err.startswith(f"error: . is inside the run folder {finished_run}, whose config.yaml")
    assert main([str(finished_run / "config.yaml"), "--repo-id", "someone/tiny-books"]) == 1
    assert capsys.readouterr().err == (
        f"error: run folder {finished_run / 'config.yaml'} is a file; give the folder a run trained in (its out_dir)\n"
    )


@pytest.mark.parametrize("private", [False, True], ids=["public", "private"])
def test_push_offline_fails_cleanly_and_keeps_the_run(finished_run, monkeypatch, private):
    """The line says how to push later, with the flags of this push: a retry copied from it without --private made
    the repository public."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused at once
    before = tree_hashes(finished_run)
    with pytest.raises(HubError, match=r"^could not push to someone/tiny-books: .*the run folder .* is intact") as err:
        push(finished_run, "someone/tiny-books", private=private, checkpoints=private)
    flags = " --private --checkpoints" if private else ""
    assert str(err.value).endswith(
        f"push it later with: python -m training.hub {finished_run} --repo-id someone/tiny-books{flags}"
    )
    after = tree_hashes(finished_run)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing changed or lost
    assert set(after) - set(before) == {str(finished_run / "export" / "README.md")}  # only the card was added


def test_a_push_the_hub_refuses_is_one_line_ending_with_the_retry(finished_run, monkeypatch, capsys):
    """A Hub that answers the upload with an HTTP error (here 501 from the stand-in, which answers whoami only): the
    error spread over two lines, huggingface_hub's "For more information check: ..." between the reason and the
    retry."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    with hub_endpoint() as (url, _):
        monkeypatch.setattr(constants, "ENDPOINT", url)
        assert main([str(finished_run), "--repo-id", "someone/tiny-books"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"error: could not push to someone/tiny-books: HfHubHTTPError: .*501.*; the run folder .* is intact; push it "
        rf"later with: python -m training.hub {re.escape(str(finished_run))} --repo-id someone/tiny-books\n",
        err,
    ), err


def test_a_run_without_its_export_is_told_the_command_that_writes_it(finished_run, monkeypatch, capsys):
    """A run trained with --export-hf false was told to "train with --export-hf true first": its checkpoint holds
    the weights, and the export that command writes is the one the push then takes. In a folder whose path holds a
    space, the command runs as given (it was split at the space)."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    run = finished_run.rename(finished_run.with_name("my run"))
    shutil.rmtree(run / "export")
    write_checkpoint(GPT(get_preset("tiny-cpu")), checkpoint_dir(run, 2))
    assert main([str(run), "--repo-id", "someone/tiny-books"]) == 1
    said, command = capsys.readouterr().err.split(", with ")
    newest = "write it from the run's newest checkpoint, step-00000002"
    assert said == f"error: {run / 'export'} holds no transformers export: {newest}"
    argv = shlex.split(command)
    assert argv == ["python", "-m", "training.export", str(run), "--out", str(run / "export")]
    export_main(argv[3:])
    assert (write_model_card(run, "someone/tiny-books")).is_file()


def check_on_hub(monkeypatch, repo_id: str, status: int = 200, answer: dict | None = None, **kw) -> str | None:
    """check_push(repo_id) with a made-up token, against a local stand-in for the Hub answering whoami so."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    with hub_endpoint(status, answer) as (url, requests):
        monkeypatch.setattr(constants, "ENDPOINT", url)
        note = check_push(repo_id, **kw)
    assert [r["authorization"] for r in requests] == ["Bearer hf_not_a_real_token"]
    return note


def test_the_checkpoints_pushed_are_the_complete_ones(tmp_path):
    """--checkpoints uploaded everything in checkpoints/, a crash's half-written step-N.tmp/ too; upload_folder now
    gets allow_patterns that pick the complete checkpoints' files alone (filtered as huggingface_hub filters them)."""
    run = tmp_path / "run"
    for name in ("step-00000002", "step-00000004", "step-00000006.tmp", "step-00000004.old", "notes"):
        (run / "checkpoints" / name / "nested").mkdir(parents=True)
        for file in ("model.safetensors", "nested/random_states_0.pkl"):
            (run / "checkpoints" / name / file).write_text(name)
    (run / "checkpoints" / "step-00000008").write_text("a file, not a checkpoint")
    files = sorted(str(p.relative_to(run / "checkpoints")) for p in (run / "checkpoints").rglob("*") if p.is_file())
    assert list(filter_repo_objects(files, allow_patterns=checkpoint_patterns(run))) == [
        f"{step}/{file}"
        for step in ("step-00000002", "step-00000004")
        for file in ("model.safetensors", "nested/random_states_0.pkl")
    ]
    assert checkpoint_patterns(tmp_path / "untrained") == []


def test_check_push_refuses_a_malformed_repo_id_or_no_token(tmp_path, monkeypatch):
    """What a run's start-up finds for --push-to-hub before asking the Hub anything."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail
    with pytest.raises(
        HubError, match=r"^--push-to-hub 'not a repo/id!' is not a Hub repository id \(.*\); use you/name"
    ):
        check_push("not a repo/id!")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    with pytest.raises(HubError, match=r"^no Hugging Face token found: .* then launch the run again \(nothing was"):
        check_push("someone/tiny-books")  # at a run's start-up: not "push again", there was no push


@pytest.mark.parametrize("repo_id", ["you/tiny-books", "club/tiny-books", "tiny-books"])
def test_check_push_passes_a_write_token_for_its_users_or_their_organizations_namespace(monkeypatch, repo_id):
    assert check_on_hub(monkeypatch, repo_id, answer=whoami("you", orgs=["club"])) is None


WRITE = ["repo.content.read", "repo.access.read", "repo.write"]
FINE_GRAINED_PASSES = {  # repo id -> where the token may write: a namespace, or the repository itself
    "you/tiny-books": {"you": WRITE},
    "tiny-books": {"you": WRITE},
    "club/tiny-books": {"you": ["repo.content.read"], "club": WRITE},
    "club/named": {"club/named": WRITE},
}


@pytest.mark.parametrize("repo_id", FINE_GRAINED_PASSES)
def test_check_push_passes_a_fine_grained_token_where_it_may_write(monkeypatch, repo_id):
    answer = whoami("you", orgs={"club": "contributor"}, scoped=FINE_GRAINED_PASSES[repo_id])
    assert check_on_hub(monkeypatch, repo_id, answer=answer) is None


HUB_REFUSALS = {
    "expired": (401, None, "you/x", r"^the Hub refused the Hugging Face token in HF_TOKEN for --push-to-hub \(401 "),
    "read_only": (200, whoami(role="read"), "you/x", r"^the Hugging Face token 'ci' can only read, and --push-to-hub"),
    "namespace": (
        200, whoami("you", orgs=["club"]), "gpt2/x",
        r"^--push-to-hub gpt2/x: this token \(user you\) can create repositories under you, club only; "
        r"give e\.g\. you/x$",
    ),
    "org_read_role": (
        200, whoami("you", orgs={"club": "read"}), "club/x",
        r"^--push-to-hub club/x: user you can only read in the organization club; ask its admins for the "
        r"contributor role or more, or give you/x$",
    ),
    "fine_grained_read": (
        200, whoami("you", orgs=["club"], scoped={"you": ["repo.content.read"], "club/other": WRITE}), "you/x",
        r"^the fine-grained Hugging Face token 'ci' may not write to repositories under you, and --push-to-hub you/x "
        r"does: give it write access to you's repositories, or make a write token, at http://127\.0\.0\.1:\d+/",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", HUB_REFUSALS)
def test_check_push_refuses_a_token_the_push_would_fail_with(monkeypatch, case):
    status, answer, repo_id, message = HUB_REFUSALS[case]
    with pytest.raises(HubError, match=message) as refused:
        check_on_hub(monkeypatch, repo_id, status, answer)
    if case not in ("namespace", "org_read_role"):  # where to make a token that can push: the Hub's own settings page
        assert str(refused.value).endswith("/settings/tokens, then `hf auth login` or set HF_TOKEN")


@pytest.mark.parametrize("status", [429, 503])
def test_a_hub_that_cannot_say_leaves_a_note_and_the_push_for_the_end(monkeypatch, status):
    note = check_on_hub(monkeypatch, "you/x", status)
    assert note.startswith(f"note: could not check the Hub token ({status} ") and note.endswith("tried at the end")


def test_a_hub_out_of_reach_stops_at_start_up(monkeypatch):
    """Refused at once (nothing listens) or never answering (a firewall that drops packets): either way the push
    at the end could not happen, and the start waits no longer than the check's timeout."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(HubError, match=r"^cannot reach the Hub \(http://127.0.0.1:9: Connect"):
        check_push("you/x")
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.monotonic()
        later = r"push the run folder later .* \(python -m training.hub runs/x --repo-id you/x\)$"
        with pytest.raises(HubError, match=r"^cannot reach the Hub \(.*: no answer in 0.5 s\) .*" + later):
            check_push("you/x", "runs/x", timeout=0.5)
        assert time.monotonic() - start < 5


def test_the_card_gives_the_context_of_a_model_started_from_a_folder(tmp_path, prepared_books):
    """A run started from a folder (no --block-size) trains at the folder's n_positions: the card said "(context the
    model's)" where the export beside it says how many tokens."""
    parent = tmp_path / "weights"
    GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128).save_pretrained(parent)
    write_run(tmp_path / "run", prepared_books, ROWS, init_from=str(parent))
    GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=128).save_pretrained(tmp_path / "run" / "export")
    assert "| model | weights (continued) (context 128) |" in render_model_card(tmp_path / "run")


def test_the_card_names_a_model_of_the_runs_own_shape_by_that_shape(tmp_path, prepared_books):
    """n_layer / n_head / n_embd set over the preset: the card named the preset (tiny-cpu: 2 layers, 64 wide), another
    model than the one it describes."""
    write_run(tmp_path / "run", prepared_books, ROWS, n_layer=3, n_embd=48, block_size=128)
    card = render_model_card(tmp_path / "run")
    assert "# run: a 3-layer, 48-wide, 2-head GPT trained with bookgpt" in card
    assert "| model | 3-layer, 48-wide, 2-head (context 128) |" in card
    write_run(tmp_path / "run", prepared_books, ROWS)  # the preset's own shape: named by the preset
    assert "# run: a tiny-cpu GPT trained with bookgpt" in render_model_card(tmp_path / "run")


def test_usage_names_the_command_a_user_types(capsys):
    """`python -m training.hub` without --repo-id: the usage and error lines say `python -m training.hub`, not
    argparse's `hub.py` (which is not a command that runs here)."""
    with pytest.raises(SystemExit):
        main(["runs/x"])
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m training.hub "), err
    assert "python -m training.hub: error: the following arguments are required: --repo-id" in err


def test_the_card_says_what_the_val_loss_was_measured_over(finished_run, prepared_books):
    """The val loss is a mean over the launch's val windows (--eval-windows, fewer where the split holds fewer), each
    block_size tokens: the card says how many of each the final loss's launch measured, as its launch row keeps them."""
    (finished_run / "metrics.jsonl").write_text("")
    tracker = JSONLTracker(finished_run)
    for step, windows in ((0, 320), (1, 12)):  # resumed with --eval-windows 12
        values = {k: CPU_LAUNCH.get(k, 8) for k in LAUNCH_KEYS} | {"data_path": str(prepared_books), "start_step": step}
        tracker.store_init_configuration(values | {"val_windows": windows, "val_tokens": windows * 64})
        tracker.log({"train_loss": 9.25, "tokens_per_sec": 1100.0, "tokens_seen": 1024 * (step + 1)}, step=step + 1)
        tracker.log({"val_loss": 9.5 - step}, step=step + 1)
    card = render_model_card(finished_run)
    assert "| val loss (final / best) | 8.5000 / 8.5000 |\n| val loss measured on | 12 windows × 64 tokens" in card
    assert "12 windows × 64 tokens (768 tokens) spread evenly over the val split |" in card
