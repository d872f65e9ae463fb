"""README.md and docs/ (issue 33): every relative link resolves, every table renders, README stays a short landing
page with install, test and quick start first, LICENSE and CITATION.cff are there, every Python block is run (by
tests/test_api.py), every ``python -m mtmoe`` command of a bash block parses and the quick start runs end to end as
written."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path

import pytest
import yaml

import mtmoe
from conftest import REAL_DATA
from pg import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```[ \t]*$", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(markdown: str) -> str:
    """The Markdown without its fenced code blocks (each replaced by an empty line, so line structure around it
    stays: a fence between two table rows still splits the table)."""
    return FENCE.sub("", markdown)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for line in prose(path.read_text()).splitlines() if line.startswith("#")}


def section(markdown: str, heading: str) -> str:
    """The text of a ``## heading`` section, up to the next ``## ``."""
    return markdown.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def code_blocks(markdown: str, language: str) -> list[str]:
    """The contents of the ```LANGUAGE fenced blocks."""
    return re.findall(rf"^```{language}\n(.*?)^```$", markdown, flags=re.S | re.M)


def cells(row: str) -> int:
    """Columns of a table row as GitHub counts them: unescaped pipes, leading and trailing ones excluded."""
    return len(re.split(r"(?<!\\)\|", row.strip().strip("|")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or ROOT not in file.parents:
            broken.append(f"{target}: no file {file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@cache
def file_names() -> set[str]:
    """The names of the repository's files, outside hidden folders (``.git``, the ``.venv`` CI makes in the clone)
    and caches: walked once, not once per page."""
    names = set()
    for _, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name != "__pycache__"]
        names.update(files)
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_exist(page: Path) -> None:
    """A ``.py`` or ``.md`` file the prose names is in the repository (a path from the root or the page, or a bare
    name some file has), but for the reports ``bootstrap`` and ``report`` write."""
    text = re.sub(r"https?://\S+", "", prose(page.read_text()))
    missing = {name for name in re.findall(r"(?<![\w/.-])([\w/.-]+\.(?:py|md))\b", text)
               if not ((ROOT / name).exists() or (page.parent / name).exists() if "/" in name
                       else name in file_names())}
    missing -= {"bootstrap.md", "report.md"}
    assert not missing, f"{page.name} names files not in the repository: {sorted(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_render(page: Path) -> None:
    """Each run of ``|`` lines is one table: a header, a ``---`` separator, and every row as many columns. A blank
    line inside a table starts a run without a separator, which GitHub shows as text."""
    lines = prose(page.read_text()).splitlines()
    runs, current = [], []
    for number, line in enumerate(lines + [""], start=1):
        if line.lstrip().startswith("|"):
            current.append((number, line))
        elif current:
            runs.append(current)
            current = []
    for run in runs:
        first = run[0][0]
        assert len(run) >= 2 and re.fullmatch(r"\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*\|?", run[1][1].strip()), (
            f"{page.name}:{first}: a table without a header separator row (a blank line inside a table?)")
        widths = {cells(line) for _, line in run}
        assert len(widths) == 1, f"{page.name}:{first}: rows of {sorted(widths)} columns"


def test_readme_is_a_short_landing_page() -> None:
    text = README.read_text()
    words = len(re.findall(r"\S+", text))
    assert words < 2000, f"README.md has {words} words"
    first_screen = "\n".join(text.splitlines()[:60])
    for needed in ("## Install", "pip install -e '.[dev]'", "download.pytorch.org/whl/cpu", "## Test",
                   "python -m pytest", "## Quick start"):
        assert needed in first_screen, f"{needed!r} is not in README's first 60 lines"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[dev]'" in ci and "\npython -m pytest\n" in ci  # CI runs what README says


def test_every_python_block_is_the_api_section_tests_run() -> None:
    """tests/test_api.py runs the Python blocks of docs/training.md's "Python API"; no page shows any other."""
    shown = [block for page in PAGES for block in code_blocks(page.read_text(), "python")]
    api = code_blocks(section((ROOT / "docs" / "training.md").read_text(), "Python API"), "python")
    assert len(api) == 3 and shown == api


def test_license_and_citation() -> None:
    license_ = (ROOT / "LICENSE").read_text()
    assert license_.startswith("MIT License\n") and "Copyright (c) 2026 the mtmoe authors" in license_
    assert 'license = { text = "MIT" }' in (ROOT / "pyproject.toml").read_text()
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0"
    for key in ("message", "title", "authors", "type", "license", "preferred-citation"):
        assert citation[key], key
    assert citation["type"] == "software" and citation["license"] == "MIT"
    paper = citation["preferred-citation"]
    assert paper["type"] == "conference-paper" and paper["title"].startswith("COMET: ")
    assert paper["doi"] == "10.1145/3580305.3599278" and paper["year"] == 2023
    assert [a["family-names"] for a in paper["authors"]][0] == "Ibrahim"


def quick_start_env(tmp_path: Path) -> dict[str, str]:
    data = Path(os.environ.get("MTMOE_DATA") or REAL_DATA)
    if not (data / "ml-100k" / "u.data").is_file():
        pytest.skip(f"no MovieLens-100K under {data}")
    bin_dir = str(Path(sys.executable).parent)  # python and optuna-dashboard of this environment
    return {**os.environ, "MTMOE_DATA": str(data), "MTMOE_CACHE": str(tmp_path / "cache"), "MTMOE_VERIFY": "true",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)  # a few minutes on an idle 2-core machine; 16 minutes measured at load average 11
def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    """README's quick start, its first bash block run by bash in an empty folder on the real MovieLens-100K, then its
    dashboard command on a free port until the dashboard answers. Its fit is the suite's check that a model learns
    from the real data."""
    commands, dashboard = code_blocks(section(README.read_text(), "Quick start"), "bash")
    env = quick_start_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=work, env=env, capture_output=True,
                          text=True, timeout=1700)
    assert done.returncode == 0, done.stderr[-4000:]
    test = json.loads((work / "runs" / "lightning_logs" / "version_0" / "results.json").read_text())["test"]
    assert test["watch/auroc"] > 0.75  # the few epochs of the real data already separate watched from sampled movies
    assert test["rating/mse"] < 1.5  # a constant predictor's MSE on ML-100K ratings is about 1.27: it is learning
    assert 1.0 <= test["watch/experts_per_sample"] <= 16.0
    table = mtmoe.trials(f"sqlite:///{work / 'studies' / 'optuna.db'}", data="movielens-100k")
    assert table.groupby("gate")["objective"].count().to_dict() == {"comet": 8, "topk": 8}
    assert table["objective"].lt(float("inf")).all()
    reports = work / "studies" / "reports" / "movielens-100k"
    assert (reports / "report.md").is_file() and (reports / "bootstrap.png").stat().st_size > 0
    assert "movielens-100k,0.9,comet,topk," in (reports / "bootstrap_factors.csv").read_text()

    assert dashboard.strip() == "optuna-dashboard sqlite:///studies/optuna.db"
    port = free_port()
    server = subprocess.Popen([*dashboard.split(), "--port", str(port)], cwd=work, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as answer:
                    body = answer.read().decode()
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None and time.monotonic() < deadline, server.stderr.read().decode()[-2000:]
                time.sleep(0.5)
        assert "movielens-100k/topk" in body and "movielens-100k/comet" in body
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_quick_start_fits_the_local_search_window_in_the_run() -> None:
    """The issue's first stumble: a "+" fit whose --model.perm_epochs (default 5) is longer than --trainer.max_epochs
    is refused; the quick start's must fit."""
    commands = code_blocks(section(README.read_text(), "Quick start"), "bash")[0]
    epochs = {flag: int(value) for flag, value in re.findall(r"--(model\.perm_epochs|trainer\.max_epochs) (\d+)",
                                                             commands.split("\nfor ")[0])}
    assert epochs["model.perm_epochs"] < epochs["trainer.max_epochs"]


#: The shell variables of the docs' command blocks, as their loops and recipes set them.
SHELL_ENV = {"PATH": "/usr/bin:/bin", "gate": "topk", "MTMOE_STORAGE": "postgresql://mtmoe@dbhost/mtmoe"}


def shown_commands() -> list[tuple[str, list[str]]]:
    """Every ``python -m mtmoe`` command of the bash blocks of README.md and docs/ as ``(page:line, words)``: the
    words bash gives it (continuations joined, comments dropped, ``$gate`` the first gate its loop names)."""
    commands = []
    for page in PAGES:
        text = page.read_text()
        for block in re.finditer(r"^```bash\n(.*?)^```$", text, flags=re.S | re.M):
            first = text[:block.start()].count("\n") + 2
            for offset, line in enumerate(block.group(1).splitlines()):
                if "python -m mtmoe" not in line or line.lstrip().startswith("#"):
                    continue
                command = re.sub(r"\\\n\s*", " ", "\n".join(block.group(1).splitlines()[offset:]))
                command = command.splitlines()[0]
                words = shell_words(command[command.index("python -m mtmoe"):], SHELL_ENV)
                commands.append((f"{page.relative_to(ROOT)}:{first + offset}", words[3:]))
    return commands


def shell_words(command: str, env: dict[str, str]) -> list[str]:
    """The words bash splits ``command`` into, its variables expanded from ``env``, its comment dropped."""
    return subprocess.run(["bash", "-c", 'printf "%s\\n" ' + command], capture_output=True, text=True, env=env,
                          check=True).stdout.splitlines()


def check_fit_options(command: str, args: list[str], capsys) -> None:
    """``args`` parse as ``fit``/``validate``/``test`` parses them (``--print_config``: nothing is read or run)."""
    from conftest import run_cli

    if "--ckpt_path" in [arg.partition("=")[0] for arg in args]:  # the checkpoint names the dataset:
        assert run_cli([command, "--help"]) == 0  # run by tests/test_cli.py::test_test_takes_the_dataset_from_...
        shown = capsys.readouterr().out
        assert all(arg.partition("=")[0] in shown for arg in args if arg.startswith("--"))
        return
    assert run_cli([command, *args, "--print_config"]) == 0, capsys.readouterr().err
    capsys.readouterr()


@pytest.mark.parametrize("where, words", shown_commands(), ids=[where for where, _ in shown_commands()])
def test_every_command_the_docs_show_parses(where: str, words: list[str], capsys) -> None:
    """Each ``python -m mtmoe`` command of a bash block parses as the command parses it: its command exists, its
    flags and the names they take; a ``tune``'s fit options as ``fit`` parses them. Nothing trains (the README's
    quick start runs in full in :func:`test_quick_start_runs_as_written`)."""
    from conftest import run_cli
    from mtmoe.tuning.bootstrap_report import parse_bootstrap_args
    from mtmoe.tuning.report import parse_report_args
    from mtmoe.tuning.storage import check_url
    from mtmoe.tuning.study import pack_size, parse_tune_args

    command, args = (words[0], words[1:]) if words else ("--help", [])
    if command in ("fit", "validate", "test"):
        check_fit_options(command, args, capsys)
    elif command == "tune":
        parsed, overrides = parse_tune_args(args)
        pack_size(parsed.pack)
        if parsed.storage:
            check_url(parsed.storage)
        check_fit_options("fit", ["--gate", parsed.gate, "--data", parsed.data, *overrides], capsys)
    elif command == "report":
        parse_report_args(args)
    elif command == "bootstrap":
        parse_bootstrap_args(args)
    else:  # --help, gates, datasets: cheap, run in full
        assert run_cli(words) == 0, capsys.readouterr().err
