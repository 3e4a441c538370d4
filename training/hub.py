"""Model card for a run's transformers export, and pushing it to the Hugging Face Hub.

    python -m training.hub runs/x --repo-id you/bookgpt-small [--private] [--checkpoints]

A failed push (no token, no network) raises one HubError; the run folder is never modified beyond the
model card and loss plot written into its export/ folder.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

import yaml

from modeling.runs import read_metrics


class HubError(RuntimeError):
    """A push that could not happen; the message says why and how to retry."""


def _retry_hint(run_dir: Path, repo_id: str) -> str:
    return (
        f"the run folder {run_dir} is intact; push it later with: python -m training.hub {run_dir} --repo-id {repo_id}"
    )


def require_token(token: str | None = None) -> str:
    """The Hub token to use, or a HubError saying how to provide one (checked before training starts)."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token found: run `hf auth login` or set HF_TOKEN, then push again")
    return token


def render_model_card(run_dir: str | Path) -> str:
    """A README.md for the export: data, config, steps, tokens, losses, throughput and the loss plot."""
    run_dir = Path(run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if "train_loss" in r]
    val = [r for r in rows if "val_loss" in r]
    if not train:
        raise HubError(f"{run_dir}/metrics.jsonl has no training rows: train the run before writing its card")
    last = train[-1]
    # The first step (compile, warm-up) is timed apart, so a one-step run has no throughput row.
    speeds = [r["tokens_per_sec"] for r in train if "tokens_per_sec" in r]
    throughput = f"{statistics.median(speeds):,.0f} tokens/s" if speeds else "n/a (one step)"
    manifest_path = Path(config["data_dir"]) / "manifest.json"
    data_line = f"`{config['data_dir']}`"
    if manifest_path.is_file():
        manifest = yaml.safe_load(manifest_path.read_text())  # JSON is YAML
        splits = manifest["splits"]
        data_line = (
            f"source `{manifest['source']}`: {splits['train']['num_documents']} train documents "
            f"({splits['train']['num_tokens']:,} tokens), {splits['val']['num_documents']} val documents "
            f"({splits['val']['num_tokens']:,} tokens), GPT-2 BPE"
        )
    val_line = score_lines = ""
    if val:
        best_val = min(r["val_loss"] for r in val)
        val_line = f"| val loss (final / best) | {val[-1]['val_loss']:.4f} / {best_val:.4f} |\n"
        scores = {k: v for k, v in val[-1].items() if k.startswith(("hellaswag", "lambada"))}
        score_lines = "".join(f"| {name.replace('_', ' ')} (final) | {value:.4f} |\n" for name, value in scores.items())
    init_from = config.get("init_from")
    model = f"{init_from} (continued)" if init_from else config["preset"]
    origin = f"from the weights of {init_from}" if init_from else "from scratch"
    return f"""---
library_name: transformers
pipeline_tag: text-generation
license: mit
tags: [gpt2, text-generation, bookgpt, pretraining]
---

# {run_dir.name}: a {model} GPT trained with bookgpt

A GPT-2-architecture model pretrained {origin} on public-domain books with bookgpt
(a pretraining project built on Hugging Face Accelerate).

## Training data
{data_line}

## Training
| | |
|---|---|
| model | {model} (context {config["block_size"] or "the model's"}) |
| optimizer steps | {last["step"]:,} |
| tokens seen | {last["tokens_seen"]:,} |
| batch | {config["total_batch_tokens"]:,} tokens/step, micro-batch {config["micro_batch_size"]} |
| learning rate | {config["lr"]} peak, cosine to {config["min_lr_ratio"]}×, {config["warmup_steps"]} warmup steps |
| final train loss | {last["train_loss"]:.4f} |
{val_line}{score_lines}| throughput (median) | {throughput} |

![loss curve](loss.png)

## Use
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("REPO_ID")
model = AutoModelForCausalLM.from_pretrained("REPO_ID")
out = model.generate(**tok("ROMEO:", return_tensors="pt"), max_new_tokens=50, do_sample=True, top_k=50)
print(tok.decode(out[0]))
```
"""


def write_model_card(run_dir: str | Path, repo_id: str | None = None) -> Path:
    """Write README.md (and loss.png when present) into the run's export folder."""
    run_dir = Path(run_dir)
    export = run_dir / "export"
    if not (export / "config.json").is_file():
        raise HubError(f"{export} holds no transformers export: train with --export-hf true first")
    card = render_model_card(run_dir)
    if repo_id:
        card = card.replace("REPO_ID", repo_id)
    (export / "README.md").write_text(card)
    if (run_dir / "loss.png").is_file():
        shutil.copyfile(run_dir / "loss.png", export / "loss.png")
    return export / "README.md"


def push(
    run_dir: str | Path, repo_id: str, *, private: bool = False, checkpoints: bool = False, token: str | None = None
) -> str:
    """Upload the export (with its model card) and optionally the training checkpoints; returns the repo URL."""
    from huggingface_hub import HfApi

    run_dir = Path(run_dir)
    token = require_token(token)
    write_model_card(run_dir, repo_id)
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=run_dir / "export", commit_message="Upload bookgpt export")
        if checkpoints and (run_dir / "checkpoints").is_dir():
            api.upload_folder(
                repo_id=repo_id, folder_path=run_dir / "checkpoints", path_in_repo="checkpoints",
                commit_message="Upload training checkpoints",
            )  # fmt: skip
    except Exception as err:  # network, auth and Hub errors all end the same way for the user
        raise HubError(
            f"could not push to {repo_id}: {type(err).__name__}: {err}; {_retry_hint(run_dir, repo_id)}"
        ) from err
    return str(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Push a finished run's transformers export to the Hugging Face Hub.")
    parser.add_argument("run_dir", help="run folder (holds config.yaml, metrics.jsonl and export/)")
    parser.add_argument("--repo-id", required=True, help="Hub repository, e.g. you/bookgpt-small")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--checkpoints", action="store_true", help="also upload the training checkpoints")
    args = parser.parse_args(argv)
    try:
        url = push(args.run_dir, args.repo_id, private=args.private, checkpoints=args.checkpoints)
    except HubError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"pushed {args.run_dir}/export to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
