"""Model card rendering and push_to_hub up to the network boundary (offline here: a clean error, nothing lost)."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml

from data_prep.tokenizer import get_encoding
from modeling.config import get_preset
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from training.config import TrainConfig, config_to_yaml
from training.hub import HubError, main, push, render_model_card, write_model_card


@pytest.fixture
def finished_run(tmp_path, prepared_books):
    """A run folder as train_accel.py leaves it: config.yaml, metrics.jsonl, export/."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = TrainConfig(preset="tiny-cpu", data_dir=str(prepared_books), total_batch_tokens=1024, max_steps=2)
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    rows = [
        {"step": 0, "val_loss": 10.9},
        {"step": 1, "train_loss": 10.5, "tokens_per_sec": 900.0, "tokens_seen": 1024},
        {"step": 2, "train_loss": 9.25, "tokens_per_sec": 1100.0, "tokens_seen": 2048},
        {"step": 2, "val_loss": 9.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    export_hf(GPT(get_preset("tiny-cpu")), run / "export", get_encoding())
    return run


def test_model_card_reports_the_run(finished_run, prepared_books):
    card = render_model_card(finished_run)
    front_matter = yaml.safe_load(card.split("---")[1])
    assert front_matter["library_name"] == "transformers" and front_matter["pipeline_tag"] == "text-generation"
    manifest = json.loads((prepared_books / "manifest.json").read_text())
    assert f"{manifest['splits']['train']['num_tokens']:,} tokens" in card
    assert "| optimizer steps | 2 |" in card and "| tokens seen | 2,048 |" in card
    assert "| final train loss | 9.2500 |" in card
    assert "| val loss (final / best) | 9.5000 / 9.5000 |" in card
    assert "| throughput (median) | 1,000 tokens/s |" in card


def test_write_model_card_fills_repo_id(finished_run):
    path = write_model_card(finished_run, "someone/tiny-books")
    assert 'from_pretrained("someone/tiny-books")' in path.read_text()


def tree_hashes(folder):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_without_token_is_a_clear_error(finished_run, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    before = tree_hashes(finished_run)
    assert main([str(finished_run), "--repo-id", "someone/tiny-books"]) == 1
    assert "no Hugging Face token found: run `hf auth login` or set HF_TOKEN" in capsys.readouterr().err
    assert tree_hashes(finished_run) == before  # checked before anything is written


def test_push_offline_fails_cleanly_and_keeps_the_run(finished_run, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused at once
    before = tree_hashes(finished_run)
    with pytest.raises(HubError, match=r"could not push to someone/tiny-books: .*the run folder .* is intact"):
        push(finished_run, "someone/tiny-books")
    after = tree_hashes(finished_run)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing changed or lost
    assert set(after) - set(before) == {str(finished_run / "export" / "README.md")}  # only the card was added
