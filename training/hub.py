"""Model card for a run's transformers export, and pushing it to the Hugging Face Hub.

    python -m training.hub runs/x --repo-id you/bookgpt-small [--private] [--checkpoints]

A failed push (no token, no network) raises one HubError; the run folder is never modified beyond the
model card and loss plot written into its export/ folder.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import statistics
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from data_prep.sources import DEFAULT_CORPUS, LICENSES, SOURCE_START
from modeling.disk import atomic_write_bytes
from modeling.runs import (
    CONFIG_FILE,
    EXPORT_DIR,
    LOSS_PLOT,
    METRICS_FILE,
    SHAPE_FIELDS,
    checkpoint_step,
    export_step,
    is_hub_id,
    list_checkpoints,
    model_shape,
    named,
    read_metrics,
    run_of_checkpoint,
)
from training.config import TrainConfig, run_steps
from training.metrics import data_for_the_card, precision_name
from training.optim import highest_multiplier
from training.runlock import run_in_progress

if TYPE_CHECKING:
    from huggingface_hub import ModelCardData
    from huggingface_hub.errors import HfHubHTTPError


class HubError(RuntimeError):
    """A push that could not happen; the message says why and how to retry."""


def _push_command(run_dir: Path, repo_id: str, private: bool, checkpoints: bool) -> str:
    """The command that pushes the run as this push would have: with its flags (a private repository made public by
    a retry copied from a line would publish the model)."""
    flags = " --private" * private + " --checkpoints" * checkpoints
    return f"python -m training.hub {shlex.quote(str(run_dir))} --repo-id {repo_id}{flags}"


def _retry_hint(run_dir: Path, repo_id: str, private: bool, checkpoints: bool) -> str:
    command = _push_command(run_dir, repo_id, private, checkpoints)
    return f"the run folder {run_dir} is intact; push it later with: {command}"


def require_token(then: str = "push again") -> str:
    """The Hub token to use, or a HubError saying how to provide one and `then` what to do (checked before training
    starts)."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise HubError(f"no Hugging Face token found: run `hf auth login` or set HF_TOKEN, then {then}")
    return token


# Benchmark scores the training loop logs (evals.runner) -> (task, its Hub dataset, split, metric type, metric name).
EVAL_METRICS = {
    "hellaswag_acc_norm": ("HellaSwag", "Rowan/hellaswag", "validation", "acc_norm", "accuracy (length-normalized)"),
    "hellaswag_acc": ("HellaSwag", "Rowan/hellaswag", "validation", "accuracy", "accuracy"),
    "lambada_acc": ("LAMBADA (OpenAI)", "EleutherAI/lambada_openai", "test", "accuracy", "last-word accuracy"),
    # per token of the last word (evals.lambada): lm-eval-harness's LAMBADA perplexity is per word, and higher
    "lambada_ppl": (
        "LAMBADA (OpenAI)",
        "EleutherAI/lambada_openai",
        "test",
        "perplexity",
        "last-word perplexity per token",
    ),
}
PUBLIC_DOMAIN = LICENSES["gutenberg"]  # what the manifest records for public-domain books
# The run config's fields the lr schedule reads (training.optim.lr_multiplier)
SCHEDULE_KEYS = ("lr_schedule", "warmup_steps", "decay_fraction", "decay_steps", "min_lr_ratio")


def _manifest(config: dict, rows: Sequence[dict] = ()) -> dict | None:
    """The run's data manifest, as much of it as the card shows: as its newest launch recorded it (metrics.jsonl's
    launch rows: training.metrics.data_for_the_card), else where that launch found it (the absolute path, so a card
    rendered from another working folder finds it too), else at its data_dir as given (runs from before both)."""
    recorded = [r["launch"]["data"] for r in reversed(rows) if r.get("launch", {}).get("data")]
    if recorded:
        # a run that went on from other data (--on-new-data continue) trained on each launch's: the card names every
        # source with its license, and the newest data's splits and sources (its val split gave the last val loss)
        every = [s for m in reversed(recorded) for s in _recorded_sources(m)]
        return {**recorded[0], "sources": every, "val_sources": _recorded_sources(recorded[0])}
    launched = [r["launch"]["data_path"] for r in reversed(rows) if "data_path" in r.get("launch", {})]
    for folder in [*launched[:1], config["data_dir"]]:
        if (found := data_for_the_card(folder)) is not None:
            return found
    return None


def _recorded_sources(manifest: dict) -> list[dict]:
    return manifest.get("sources") or [
        {"source": manifest["source"], "license": "unknown (prepared before licenses were recorded)", "dataset": None}
    ]


def data_sources(manifest: dict | None) -> list[dict]:
    """The data's parts with the license and Hub dataset id that prepare recorded for each, each source as the card
    shows it (shown_source), each once."""
    if manifest is None:
        return []
    shown = [{**s, "source": shown_source(s["source"], s["dataset"])} for s in _recorded_sources(manifest)]
    return [s for i, s in enumerate(shown) if s not in shown[:i]]


def shown_source(source: str, dataset: str | None) -> str:
    """A source spec as a model card shows it: a local folder or file by its name (files:library, hf:books.parquet),
    not by where it lay on the machine that trained, which is that machine's business and means nothing to the card's
    readers (a local copy of PG-19 too, whose Hub dataset the card names beside it); Hub datasets, Gutenberg ids and
    the default corpus as given."""
    parts = []
    for part in SOURCE_START.split(source):
        kind, sep, arg = part.strip().partition(":")
        if kind not in ("files", "hf", "pg19") or not arg or (kind == "hf" and dataset):  # a Hub id: no path
            parts.append(part.strip())
            continue
        path, colon, rest = arg.partition(":") if kind == "hf" else (arg, "", "")
        local = Path(path)
        # a pattern from the folder above its first wildcard: lib/**/*.txt, books/*.txt
        magic = [i for i, piece in enumerate(local.parts) if glob.has_magic(piece)]
        pieces = local.parts[max(magic[0] - 1, 0) :] if magic else (local.name,)
        name = "/".join(piece for piece in pieces if piece != local.anchor)
        parts.append(f"{kind}{sep}{name or path}{colon}{rest}")
    return "+".join(parts)


def card_data(run_name: str, config: dict, manifest: dict | None, evals: dict[str, float]) -> ModelCardData:
    """The card's metadata: license, tags, the Hub datasets trained on, the base model, and `evals` (the last eval
    row: val_loss, benchmark scores) as model-index results."""
    from huggingface_hub import EvalResult, ModelCardData  # 0.3 s of imports: paid by the runs that write a card

    sources = data_sources(manifest)
    hub_datasets = sorted({s["dataset"] for s in sources if s["dataset"]})
    results = []
    if "val_loss" in evals:
        # the newest data's val split: a run that went on from other data trained on more sources than it measured
        held_out = data_sources({"sources": manifest["val_sources"]}) if "val_sources" in (manifest or {}) else sources
        val_datasets = [s["dataset"] for s in held_out if s["dataset"]]
        data = val_datasets[0] if len(held_out) == 1 and val_datasets else "+".join(s["source"] for s in held_out)
        results.append(
            EvalResult(
                task_type="text-generation",
                dataset_type=data,
                dataset_name=f"{data} (held-out books)",
                dataset_split="val",
                metric_type="loss",
                metric_name="val loss (nats/token)",
                metric_value=round(evals["val_loss"], 4),
            )  # fmt: skip
        )
    limit = {"limit": config["eval_limit"]} if config.get("eval_limit") else None
    for key, (task, dataset, split, metric, name) in EVAL_METRICS.items():
        if key in evals:
            results.append(
                EvalResult(
                    task_type="text-generation",
                    dataset_type=dataset,
                    dataset_name=task,
                    dataset_split=split,
                    dataset_args=limit,
                    metric_type=metric,
                    metric_name=f"{name}, zero-shot",
                    metric_value=round(evals[key], 4),
                )  # fmt: skip
            )
    init_from = config.get("init_from")
    return ModelCardData(
        model_name=run_name,
        library_name="transformers",
        pipeline_tag="text-generation",
        # bookgpt's, under which its code writes these weights, unless the data's is unknown (the text says so)
        license="unknown" if not sources or any(s["license"].startswith("unknown") for s in sources) else "mit",
        tags=["gpt2", "text-generation", "bookgpt", "pretraining"],
        datasets=hub_datasets or None,
        base_model=init_from if init_from and is_hub_id(init_from) else None,
        eval_results=results or None,
    )


def check_model_card(config: dict) -> None:
    """Raise now what writing the card would raise at the end (huggingface_hub, the data's manifest)."""
    from huggingface_hub import ModelCard

    ModelCard(f"---\n{card_data('check', config, _manifest(config), {'val_loss': 1.0}).to_yaml()}\n---\n")


# How long the start-up check waits for the Hub's answer: huggingface_hub's session has no timeout of its own, and
# behind a firewall that drops packets the start would otherwise hang.
WHOAMI_TIMEOUT_S = 30.0


def check_repo_id(repo_id: str, flag: str) -> None:
    """HubError for a repository id the Hub would refuse, before anything is written or asked."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise HubError(f"{flag} {repo_id!r} is not a Hub repository id ({err}); use you/name") from None


def check_push(
    repo_id: str, run_dir: str = "RUN_FOLDER", *, private: bool = False, timeout: float = WHOAMI_TIMEOUT_S
) -> str | None:
    """Raise now, as one HubError, what would stop push(repo_id) at the end of the run: a malformed repo id, no
    token, or what the Hub says of the token (one whoami call): refused (expired, revoked), read-only, fine-grained
    without write access there, not its user's nor their organizations' namespace, or an organization where the
    user's role is read; a Hub out of reach stops the run too, as the push could not happen.
    Returns a note where the Hub answered without saying (a rate limit, a server error): the push is then tried at
    the end."""
    from huggingface_hub import constants

    check_repo_id(repo_id, "--push-to-hub")
    token = require_token(then="launch the run again (nothing was trained)")
    try:
        answer = _whoami(token, timeout)
    except ConnectionError as err:
        raise HubError(
            f"cannot reach the Hub ({constants.ENDPOINT}: {err}) to check the token for --push-to-hub, so the push at "
            "the end would fail too: train without it and push the run folder later where the Hub can be reached "
            f"({_push_command(Path(run_dir), repo_id, private, False)})"
        ) from None
    new_token = f"make a write token at {constants.ENDPOINT}/settings/tokens, then `hf auth login` or set HF_TOKEN"
    if not isinstance(answer, dict):  # the Hub answered with an HTTP error
        reason = f"{answer.response.status_code} {answer.response.reason_phrase}"
        if answer.response.status_code == 401:
            where = "in HF_TOKEN " if os.environ.get("HF_TOKEN") else ""  # HF_TOKEN wins over `hf auth login`'s
            raise HubError(f"the Hub refused the Hugging Face token {where}for --push-to-hub ({reason}): {new_token}")
        return f"note: could not check the Hub token ({reason}); the push to {repo_id} is tried at the end"
    access = (answer.get("auth") or {}).get("accessToken") or {}
    token_name = access.get("displayName", "")
    if access.get("role") == "read":
        raise HubError(f"the Hugging Face token {token_name!r} can only read, and --push-to-hub writes: {new_token}")
    user = answer["name"]
    roles = {org["name"]: org.get("roleInOrg") for org in answer.get("orgs", [])}
    namespaces = [user, *roles]
    namespace, _, name = repo_id.rpartition("/")
    namespace = namespace or user  # a bare name is created under the token's user
    if namespace not in namespaces:
        raise HubError(
            f"--push-to-hub {repo_id}: this token (user {user}) can create repositories under "
            f"{', '.join(namespaces)} only; give e.g. {user}/{name}"
        )
    if roles.get(namespace) == "read":  # the organization's read role: no repositories of one's own there
        raise HubError(
            f"--push-to-hub {repo_id}: user {user} can only read in the organization {namespace}; ask its admins "
            f"for the contributor role or more, or give {user}/{name}"
        )
    # A fine-grained token writes only where it was granted repo.write: on a whole namespace, or on named repositories.
    fine = access.get("fineGrained")
    if access.get("role") == "fineGrained" and isinstance(fine, dict):
        granted = {s["entity"]["name"] for s in fine.get("scoped", []) if "repo.write" in s.get("permissions", [])}
        if namespace not in granted and f"{namespace}/{name}" not in granted:
            raise HubError(
                f"the fine-grained Hugging Face token {token_name!r} may not write to repositories under {namespace}, "
                f"and --push-to-hub {repo_id} does: give it write access to {namespace}'s repositories, or make a "
                f"write token, at {constants.ENDPOINT}/settings/tokens, then `hf auth login` or set HF_TOKEN"
            )
    return None


def _whoami(token: str, timeout: float) -> dict | HfHubHTTPError:
    """The Hub's whoami answer for `token`, or the HTTP error it answered with; a ConnectionError saying why where
    no answer came (no route, refused, none in `timeout` seconds)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    answer: dict[str, object] = {}

    def ask() -> None:
        try:
            answer["info"] = HfApi(token=token).whoami()
        except Exception as err:  # read below, in the caller's thread
            answer["error"] = err

    # A daemon thread: one stuck on a socket that never answers is left behind and does not hold the exit.
    thread = threading.Thread(target=ask, name="hub-whoami", daemon=True)
    thread.start()
    thread.join(timeout)
    err = answer.get("error")
    if "info" in answer or (isinstance(err, HfHubHTTPError) and err.response is not None):
        return answer.get("info", err)
    raise ConnectionError(f"{type(err).__name__}: {err}" if err else f"no answer in {timeout:g} s")


def render_model_card(run_dir: str | Path) -> str:
    """A README.md for the export (huggingface_hub's ModelCard): data and its license, optimizer(s), lrs, schedule
    and batch as each launch up to the newest checkpoint (the export's weights) trained with them, steps, tokens,
    losses, eval results, throughput and the loss plot."""
    from huggingface_hub import ModelCard

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / METRICS_FILE)
    config_file = run_dir / CONFIG_FILE
    if checkpoints := list_checkpoints(run_dir):
        # the steps the exported weights took (those of the newest checkpoint, write_model_card checks), under the
        # config that checkpoint was saved with: a resume killed before its first save logged steps after it (which
        # the next resume drops and trains again) and wrote its own config.yaml
        saved = checkpoint_step(checkpoints[-1])
        rows = [r for r in rows if (r.get("step") or 0) <= saved]
        if (checkpoints[-1] / CONFIG_FILE).is_file():  # not in checkpoints from before saves copied it
            config_file = checkpoints[-1] / CONFIG_FILE
    config = yaml.safe_load(config_file.read_text())
    train = [r for r in rows if "train_loss" in r]
    val = [r for r in rows if "val_loss" in r]
    if not train:
        raise HubError(f"{run_dir}/metrics.jsonl has no training rows: train the run before writing its card")
    last = train[-1]
    manifest = _manifest(config, rows)
    val_line = score_lines = ""
    evals = {k: v for k, v in val[-1].items() if k != "step"} if val else {}
    # the launches that went on from other data (--on-new-data continue), by their index in rows
    switches = [i for i, r in enumerate(rows) if r.get("launch", {}).get("new_data")]
    if val:
        # the best since the run last went on from other data: earlier losses are another val split's
        since = rows[switches[-1] + 1 :] if switches else rows
        best_val = min([r["val_loss"] for r in since if "val_loss" in r] or [val[-1]["val_loss"]])
        val_line = f"| val loss (final / best) | {val[-1]['val_loss']:.4f} / {best_val:.4f} |\n"
        val_line += _val_set_line(rows, val[-1]["step"])
        # a score on the first N examples is no measure of the whole task: the text says so, as the metadata does
        subset = f", first {config['eval_limit']:,} examples" if config.get("eval_limit") else ""
        score_lines = "".join(
            f"| {name.replace('_', ' ')} (final{subset}) | {evals[name]:.4f} |\n"
            for name in EVAL_METRICS
            if name in evals
        )
    if init_from := config.get("init_from"):
        started, local = _started_from(init_from)
        model, origin = f"{started} (continued)", f"from the weights of {started}{' (a local model)' * local}"
    else:
        model, origin = _scratch_model(config), "from scratch"
    name = run_dir.resolve().name  # the folder's own name, also where it was given as "." from inside it
    data = card_data(name, config, manifest, evals)
    launches = _launches(rows, last["step"])
    how = _batch_line(config, launches, last["step"]) + _hardware_line(launches, last["step"]) + _time_line(train)
    schedule = _recipe_line(config, launches, last["step"], _schedule_line) + _warmup_note(config, rows, last["step"])
    schedule += _rewarm_note(launches)
    content = f"""---
{data.to_yaml()}
---

# {name}: a {model} GPT trained with bookgpt

A GPT-2-architecture model pretrained {origin} with bookgpt (a pretraining project built on Hugging Face
Accelerate, MIT-licensed).

## Training data
{_data_section(config, manifest)}{_new_data_line([rows[i]["step"] + 1 for i in switches])}

## Training
| | |
|---|---|
| model | {model} (context {_context(run_dir, config)}) |
| optimizer | {_recipe_line(config, launches, last["step"], _optimizer_line)} |
| lr schedule | {schedule} |
| optimizer steps | {_steps(config, rows, last["step"])} |
| tokens seen | {_tokens_line(last["tokens_seen"], manifest, switches)} |
{how}| final train loss | {last["train_loss"]:.4f} |
{val_line}{score_lines}| throughput (median) | {_throughput(train, launches, last["step"])} |

![loss curve](loss.png)

## Use
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("REPO_ID")
model = AutoModelForCausalLM.from_pretrained("REPO_ID")
# as many new tokens as generation_config.json says (half the context, at most 256): prompt and text must fit in it
out = model.generate(**tok("ROMEO:", return_tensors="pt"), do_sample=True, top_k=50)
print(tok.decode(out[0]))
```
"""
    return str(ModelCard(content))


def _planned_steps(config: dict, rows: list[dict], last_step: int) -> int | None:
    """The steps the run planned last, as of the launch that trained its step `last_step`; None for a time budget
    that had not decided its count yet. A launch that trained none (a finished run launched again with another
    --max-steps, one killed before its first step) planned nothing these weights took."""
    if config.get("time_budget_minutes"):  # the count it decided last (max_steps is its cap)
        decided = [r["total_steps"] for r in rows if "total_steps" in r]
        return decided[-1] if decided else None
    # also where a run went on with its budget off: its decisions are an earlier plan's. The last launch's plan (a
    # resume with another batch moves a token budget's last step); runs from before launches kept it: the config's
    plans = [launch["planned_steps"] for _, launch in _launches(rows, last_step) if "planned_steps" in launch]
    if plans:
        return plans[-1]
    return run_steps(config["max_steps"], config.get("max_tokens"), config["total_batch_tokens"])


def _steps(config: dict, rows: list[dict], step: int) -> str:
    """The steps the run took, and of how many where it stopped before its end (a signal, then an export of that
    checkpoint): the lr schedule the card gives is the whole run's; where a time budget set the count, that it did."""
    planned = _planned_steps(config, rows, step)
    if planned is None:  # stopped before the time budget decided: no count was planned yet
        return f"{step:,}"
    if step < planned:
        return f"{step:,} of {planned:,} planned (stopped early: the lr schedule above did not run to its end)"
    if budget := config.get("time_budget_minutes"):  # the count it decided: as many steps as fit, up to its cap
        cap = f"{config['max_tokens']:,} tokens" if config.get("max_tokens") else f"{config['max_steps']:,}"
        return f"{step:,} (the count a {budget:g}-minute time budget set, {cap} at most)"
    return f"{step:,}"


def _warmup_note(config: dict, rows: list[dict], last_step: int) -> str:
    """Where the warmup was as long as the run (its start-up warned): the highest lr the run trained at, which the
    schedule row's peak is not."""
    planned = _planned_steps(config, rows, last_step)
    if planned is None or config["warmup_steps"] < planned:
        return ""
    schedule = TrainConfig(**{k: config[k] for k in SCHEDULE_KEYS if k in config}, max_steps=planned)
    highest = highest_multiplier(schedule, planned)
    return f"; the run's {_plural(planned, 'step')} were all warmup: the lr reached {highest:.2f}× the peak at most"


def _val_set_line(rows: list[dict], val_step: int) -> str:
    """The card's row saying what the val loss at `val_step` was the mean over: the windows of the launch that
    measured it (its launch row; runs from before it kept them have none, and no row)."""
    # a launch row's step is the one it started after; the first launch's also measures step 0
    launch = [r["launch"] for r in rows if "launch" in r and (r["step"] < val_step or r["step"] == 0)]
    if not launch or "val_windows" not in launch[-1]:
        return ""
    windows, tokens = launch[-1]["val_windows"], launch[-1]["val_tokens"]
    return (
        f"| val loss measured on | {windows:,} windows × {tokens // windows:,} tokens ({tokens:,} tokens) spread "
        "evenly over the val split |\n"
    )


def _scratch_model(config: dict) -> str:
    """How the card names a model trained from scratch: by its preset, or by its shape where the run set its own
    (the preset's name would tell the card's readers another model's)."""
    given = [config.get(name) for name in SHAPE_FIELDS]
    if all(value is None for value in given):
        return config["preset"]
    shape = model_shape(config["preset"], None, "", *given)
    return f"{shape.n_layer}-layer, {shape.n_embd}-wide, {shape.n_head}-head"


def _context(run_dir: Path, config: dict) -> int | str:
    """The model's context in tokens: its export's n_positions (the model the card describes, also where its shape
    came from an --init-from folder), else the run's block_size."""
    export_config = run_dir / EXPORT_DIR / "config.json"
    if export_config.is_file():
        return json.loads(export_config.read_text())["n_positions"]
    return config["block_size"] or "the model's"


def _started_from(init_from: str) -> tuple[str, bool]:
    """How the card names the weights a run started from, and whether they are a local folder: a Hub id as given; a
    folder by the model name in its own card (a bookgpt export's is its run's name), else by the folder's name: not
    by a path on the machine that trained, which means nothing to the card's readers."""
    from huggingface_hub import ModelCard

    if is_hub_id(init_from):
        return init_from, False
    folder = Path(init_from)
    name = None
    if (folder / "README.md").is_file():
        # model_name is the card's, or its model-index's (where it has eval results); metadata that does not parse
        # leaves the folder's name
        with suppress(ValueError, yaml.YAMLError):
            name = ModelCard.load(folder / "README.md").data.model_name
    return name or folder.resolve().name, True


def _data_section(config: dict, manifest: dict | None) -> str:
    if manifest is None:
        return f"`{config['data_dir']}` (no manifest.json there: source and license unknown)"
    splits = manifest["splits"]
    sources = data_sources(manifest)
    rows = "".join(
        f"| `{s['source']}`{f': {DEFAULT_CORPUS}' if s['source'].partition(':')[0] == 'default' else ''} | "
        + (f"[{s['dataset']}](https://huggingface.co/datasets/{s['dataset']})" if s["dataset"] else "not on the Hub")
        + f" | {s['license']} |\n"
        for s in sources
    )
    licenses = {s["license"] for s in sources}
    if licenses == {PUBLIC_DOMAIN}:
        note = "The books are in the public domain in the USA."
    elif any(license.startswith("unknown") for license in licenses):
        note = "The license of some of this data is unknown: check it before you share this model or its outputs."
    else:
        note = "Each source's license is as its dataset states it."
    return (
        f"{_documents(splits['train']['num_documents'], 'train')} ({splits['train']['num_tokens']:,} tokens), "
        f"{_documents(splits['val']['num_documents'], 'val')} ({splits['val']['num_tokens']:,} tokens), GPT-2 BPE.\n\n"
        f"| source | Hub dataset | license |\n|---|---|---|\n{rows}\n{note}"
    )


def _documents(count: int, split: str) -> str:
    """3 train documents, 1 val document."""
    return f"{count:,} {split} document{'s' * (count != 1)}"


def _new_data_line(steps: list[int]) -> str:
    """The steps from which the run went on from other data (--on-new-data continue), one sentence; '' where it
    never did."""
    if not steps:
        return ""
    at = ("step " if len(steps) == 1 else "steps ") + ", ".join(f"{s:,}" for s in steps)
    return (
        f"\n\nFrom {at} the run went on from the start of other data (the sources above are all it trained on; "
        "the split sizes are the last data's)."
    )


def _tokens_line(tokens: int, manifest: dict | None, switches: list[int]) -> str:
    """The tokens the run's steps read, and how many passes over the train split they were: past a few a model
    memorizes its books (the run's start-up warns), and a reader of the card learns that here. Only where the run
    trained on one data folder (its manifest known): one that went on from other data read several."""
    train = manifest["splits"]["train"]["num_tokens"] if manifest is not None and not switches else 0
    if not train:
        return f"{tokens:,}"
    epochs = tokens / train
    shown = f"{epochs:.1f}" if epochs >= 1 else f"{epochs:.2g}"  # 19.7, 0.018
    return f"{tokens:,} ({shown} epochs of the train split)"


def _launches(rows: list[dict], last_step: int) -> list[tuple[int, dict]]:
    """(first step, launch row) of each launch that trained (metrics.jsonl's launch rows; none in runs made before
    they were logged); a launch that found the run finished trained nothing."""
    return [(r["step"] + 1, r["launch"]) for r in rows if "launch" in r and r["step"] < last_step]


def _spans(launches: list[tuple[int, dict]], last_step: int, what: Callable[[dict], str]) -> list[tuple[int, int, str]]:
    """(first step, last step, what(launch)) of each span of the run's steps over which what(launch) held."""
    parts: list[tuple[int, int, str]] = []
    for i, (first, launch) in enumerate(launches):
        until = launches[i + 1][0] - 1 if i + 1 < len(launches) else last_step
        text = what(launch)
        if parts and parts[-1][2] == text:
            first = parts.pop()[0]  # the same as the launch before: one span
        parts.append((first, until, text))
    return parts


def _per_span(launches: list[tuple[int, dict]], last_step: int, what: Callable[[dict], str]) -> str:
    """what(launch) for the run's steps, with each span's steps where a resume changed it."""
    return _joined(_spans(launches, last_step, what))


def _joined(parts: list[tuple[int, int, str]]) -> str:
    if len(parts) == 1:
        return parts[0][2]
    return "; ".join(f"{_steps_from_to(a, b)}: {text}" for a, b, text in parts)


def _steps_from_to(first: int, last: int) -> str:
    """steps 1-20; step 21 (a launch that trained one step)."""
    return f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"


def _where(launch: dict) -> str:
    """Where and in what precision a launch trained."""
    compiled = "" if launch["dynamo_backend"] == "NO" else ", torch.compile"
    return f"{launch['world_size']} × {launch['device']}, {precision_name(launch['mixed_precision'])}{compiled}"


def _hardware_line(launches: list[tuple[int, dict]], last_step: int) -> str:
    """Where and in what precision each launch of the run trained: one table row."""
    if not launches:
        return ""
    return f"| hardware | {_per_span(launches, last_step, _where)} |\n"


def _throughput(train: list[dict], launches: list[tuple[int, dict]], last_step: int) -> str:
    """The median tokens/s of each span of steps on the same hardware (a median over two is neither's)."""
    parts = []
    for first, until, _ in _spans(launches, last_step, _where) or [(1, last_step, "")]:
        speeds = [r["tokens_per_sec"] for r in train if "tokens_per_sec" in r and first <= r["step"] <= until]
        # The first step (compile, warm-up) is timed apart, so a one-step launch has no throughput row.
        parts.append((first, until, f"{statistics.median(speeds):,.0f} tokens/s" if speeds else "n/a (one step)"))
    return _joined(parts)


def _recipe(config: dict, launch: dict) -> dict:
    """The run config as `launch` trained with it: its recipe (a resume may change the lr, the schedule, the batch)
    over config.yaml's (the last launch's: all there is for launch rows written before they held it)."""
    return {**config, **launch.get("recipe", {})}


def _recipe_line(config: dict, launches: list[tuple[int, dict]], last_step: int, line: Callable[[dict], str]) -> str:
    """line(the run config) for the run's steps, with each span's steps where a resume changed what it says."""
    if not launches:
        return line(config)
    return _per_span(launches, last_step, lambda launch: line(_recipe(config, launch)))


def _batch_line(config: dict, launches: list[tuple[int, dict]], last_step: int) -> str:
    """Tokens per step and the micro-batch, per span of steps where a resume changed them (the batch, or on other
    hardware the micro-batch; launch rows written before they held them: config.yaml's, the last launch's)."""

    def tokens(launch: dict) -> str:
        return f"{_recipe(config, launch)['total_batch_tokens']:,} tokens/step"

    def micro(launch: dict) -> str:
        return f"micro-batch {launch.get('micro_batch_size', config['micro_batch_size'])}"

    if not launches:
        return f"| batch | {tokens({})}, {micro({})} |\n"
    if len(_spans(launches, last_step, tokens)) == 1:  # the batch held: the micro-batch of each span
        return f"| batch | {tokens(launches[0][1])}, {_per_span(launches, last_step, micro)} |\n"
    return f"| batch | {_per_span(launches, last_step, lambda launch: f'{tokens(launch)}, {micro(launch)}')} |\n"


def _time_line(train: list[dict]) -> str:
    """The time the run spent in train steps: each logged window's mean step time times the steps since the row
    before (a launch's first step, timed apart with the compile, counted at its window's mean)."""
    seconds, before = 0.0, 0
    for row in train:
        if "step_time_s" in row:
            seconds += row["step_time_s"] * (row["step"] - before)
        before = row["step"]
    if not seconds:
        return ""
    return f"| time in train steps | {_duration(seconds)} (start-up, compile, evals and checkpoints not counted) |\n"


def _duration(seconds: float) -> str:
    """42 s, 12 min, 2 h 05 min."""
    if round(seconds) < 60:  # 59.7 s is "1 min", not "60 s"
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _optimizer_line(config: dict) -> str:
    adamw = (
        f"AdamW lr {config['lr']:g} (betas {config['beta1']:g}/{config['beta2']:g}, weight decay "
        f"{config['weight_decay']:g})"
    )
    if config["optimizer"] != "muon":
        return adamw
    muon = f"Muon lr {config['muon_lr']:g} (momentum {config['muon_momentum']:g}) on the blocks' matrices"
    return f"{muon}; {adamw} on embeddings, LayerNorms and biases"


def _schedule_line(config: dict) -> str:
    warmup, floor = _plural(config["warmup_steps"], "warmup step"), config["min_lr_ratio"]
    if config["lr_schedule"] == "wsd" and not (config.get("decay_steps") or config["decay_fraction"]):
        return f"wsd with no decay: {warmup}, then the peak lr to the last step (the stable part of a run)"
    if config["lr_schedule"] == "wsd":
        steps = config.get("decay_steps")  # not in the configs of runs from before it
        last = _plural(steps, "step") if steps else f"{config['decay_fraction']:g} of the steps"
        return f"wsd: {warmup}, constant, then linear decay over the last {last} to {floor:g}× the peak"
    return f"cosine: {warmup}, then cosine decay to {floor:g}× the peak"


def _rewarm_note(launches: list[tuple[int, dict]]) -> str:
    """Where a resume took the lr back up after its decay (a finished run trained longer: the schedule above is the
    last launch's, not the path the lr took), one clause per such launch; '' where none did."""
    return "".join(
        f"; from step {first:,} the lr went back up from {launch['rewarmed'][0]:.2f}× to {launch['rewarmed'][1]:.2f}× "
        "the peak (a resume trained the decayed run longer)"
        for first, launch in launches
        if "rewarmed" in launch
    )


def _plural(count: int, noun: str) -> str:
    """1 warmup step, 2 warmup steps."""
    return f"{count} {noun}{'s' * (count != 1)}"


def write_model_card(run_dir: str | Path, repo_id: str | None = None) -> Path:
    """Write README.md (and loss.png when present) into the run's export folder."""
    run_dir = Path(run_dir)
    export = run_dir / EXPORT_DIR
    checkpoints = list_checkpoints(run_dir)
    if not (export / "config.json").is_file():
        if not checkpoints:
            raise HubError(f"{export} holds no transformers export: train the run first (its end writes export/)")
        # a run trained with --export-hf false: its weights are in its checkpoints, no need to train it again
        raise HubError(
            f"{export} holds no transformers export: write it from the run's newest checkpoint, "
            f"{checkpoints[-1].name}, with python -m training.export {shlex.quote(str(run_dir))} --out "
            f"{shlex.quote(str(export))}"
        )
    # The run's end saves its last checkpoint, then exports: a newer checkpoint is a resume that stopped before its end
    if checkpoints and _trained_since(export, checkpoints[-1]):
        raise HubError(
            f"{export} holds the weights of an earlier end of this run, which has trained on to {checkpoints[-1].name} "
            "since (a resume stopped before its end), and its card would describe those steps: finish the run with "
            "the command that trained it (its end exports and writes the card), then push"
        )
    card = render_model_card(run_dir)
    if repo_id:
        card = card.replace("REPO_ID", repo_id)
    atomic_write_bytes(export / "README.md", card.encode())  # a crash leaves the old card or the new, never half
    if (run_dir / LOSS_PLOT).is_file():
        shutil.copyfile(run_dir / LOSS_PLOT, export / LOSS_PLOT)
    return export / "README.md"


def checkpoint_patterns(run_dir: Path) -> list[str]:
    """The upload's allow_patterns in run_dir/checkpoints/: its complete checkpoints' files, not a crash's half-written
    step-N.tmp/ (nor anything else there)."""
    return [f"{checkpoint.name}/*" for checkpoint in list_checkpoints(run_dir)]


def _trained_since(export: Path, newest: Path) -> bool:
    """Whether the run's newest checkpoint is of a later step than the export's weights: by the step the export
    recorded (a copied run folder's times are the copy's order), else (an export made before it did) by time."""
    step = export_step(export)
    if step is None:
        return newest.stat().st_mtime > (export / "config.json").stat().st_mtime
    return checkpoint_step(newest) > step


def push(run_dir: str | Path, repo_id: str, *, private: bool = False, checkpoints: bool = False) -> str:
    """Upload the export (with its model card) and optionally the training checkpoints; returns the repo URL."""
    from huggingface_hub import HfApi

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        why = "is a file" if run_dir.exists() else "does not exist"
        raise HubError(f"run folder {run_dir} {why}; give the folder a run trained in (its out_dir)")
    # a folder inside a run (its export/, a checkpoint; . from inside one) was told the run was not trained yet
    where = named(run_dir)
    run = run_of_checkpoint(where) or (where.parent if where.name == EXPORT_DIR else None)
    if run is not None and (run / CONFIG_FILE).is_file():
        raise HubError(
            f"{run_dir} is inside the run folder {run}, whose config.yaml and metrics.jsonl the model card is written "
            f"from: give the run folder, {_push_command(run, repo_id, private, checkpoints)}"
        )
    check_repo_id(repo_id, "--repo-id")  # before the model card is written for it
    token = require_token()
    write_model_card(run_dir, repo_id)
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=run_dir / EXPORT_DIR, commit_message="Upload bookgpt export")
        if checkpoints and (complete := checkpoint_patterns(run_dir)):
            api.upload_folder(
                repo_id=repo_id, folder_path=run_dir / "checkpoints", path_in_repo="checkpoints",
                allow_patterns=complete, commit_message="Upload training checkpoints",
            )  # fmt: skip
    except Exception as err:  # network, auth and Hub errors all end the same way for the user
        retry = _retry_hint(run_dir, repo_id, private, checkpoints)
        # one line: huggingface_hub's HTTP errors add a "For more information check: ..." line of their own
        said = " ".join(str(err).split())
        raise HubError(f"could not push to {repo_id}: {type(err).__name__}: {said}; {retry}") from err
    return str(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.hub", description="Push a finished run's transformers export to the Hugging Face Hub."
    )
    parser.add_argument("run_dir", help="run folder (holds config.yaml, metrics.jsonl and export/)")
    parser.add_argument("--repo-id", required=True, help="Hub repository, e.g. you/bookgpt-small")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--checkpoints", action="store_true", help="also upload the training checkpoints")
    args = parser.parse_args(argv)
    try:
        # its export and card are an earlier end's, or none yet; checked here, not in push(): the run's own end pushes
        # while it holds the lock
        if (holder := run_in_progress(Path(args.run_dir))) is not None:
            raise HubError(
                f"the run in {args.run_dir} is still training ({holder}): its end writes export/ and the model card; "
                "push once it has ended"
            )
        url = push(args.run_dir, args.repo_id, private=args.private, checkpoints=args.checkpoints)
    except HubError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"pushed {args.run_dir}/export to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
