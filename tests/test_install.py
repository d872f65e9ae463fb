"""The package as a user gets it: where its files are read from and where its commands write.

The slow test builds a wheel from this checkout, installs it into a fresh virtual environment and runs, from a
folder outside the checkout, a tiny ``fit``, ``tune``, ``report`` and ``bootstrap`` on the real MovieLens-100K:
their outputs appear where README.md says (under the current directory), and nothing is written into the installed
package. The new environment sees only the dependencies the wheel declares (and pip), linked from this
environment rather than installed again (torch and its CUDA libraries were most of the test's time:
benchmarks/README.md), so an undeclared import fails as in a user's environment; pip installs the wheel itself and
``pip check`` finds every requirement it declares met. Resolving the dependencies from the index into a fresh
environment is what CI's own installs do (``.ci/run``: ``pip install -e '.[dev]'``, plain and at the lower
bounds), from the same ``pyproject.toml``.
"""
from __future__ import annotations

import email
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from importlib.metadata import Distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REAL_DATA

CHECKOUT = Path(__file__).resolve().parents[1]
TINY = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2",
        "--trainer.limit_test_batches=2"]  # where the outputs go, not what the model learns: a few batches


def test_data_root_defaults_to_mtmoe_data_else_the_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from mtmoe.data import MovieLens100KDataModule

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MTMOE_DATA", raising=False)
    assert MovieLens100KDataModule().root == tmp_path / ".cache" / "mtmoe" / "data"
    monkeypatch.setenv("MTMOE_DATA", str(tmp_path / "elsewhere"))
    assert MovieLens100KDataModule().root == tmp_path / "elsewhere"


def test_search_spaces_and_manifest_are_package_data() -> None:
    from mtmoe.data import download
    from mtmoe.tuning.space import SPACES_DIR, space_file

    assert space_file("movielens").is_file() and "ml-100k" in json.loads(download.MANIFEST.read_text())
    assert {path.name for path in SPACES_DIR.iterdir()} >= {"movielens.yaml", "movielens-100k.yaml", "books.yaml"}


def run(command: list, cwd: Path, env: dict[str, str], timeout: int = 600) -> str:
    start = time.perf_counter()
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    print(f"{time.perf_counter() - start:6.1f} s  {' '.join(str(c) for c in command[:4])}")
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def package_files(site_packages: Path) -> set[Path]:
    return {p.relative_to(site_packages) for p in (site_packages / "mtmoe").rglob("*")
            if "__pycache__" not in p.parts}


def build_wheel(out: Path, env: dict[str, str]) -> Path:
    """The wheel of this checkout, built from a clean copy of its sources (setuptools would package a stale
    ``build/`` folder of the checkout)."""
    source = out / "source"
    shutil.copytree(CHECKOUT / "mtmoe", source / "mtmoe", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", out / "dist", source], out, env)
    (wheel,) = (out / "dist").glob("mtmoe-*.whl")
    return wheel


def runtime_requirements(wheel: Path) -> list[Distribution]:
    """The installed distributions the wheel's ``Requires-Dist`` lines need, transitively: markers evaluated for
    this interpreter, a requirement's extras followed, the wheel's own extras (``dev``, ``tensorboard``) not."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = email.message_from_bytes(archive.read(name)).get_all("Requires-Dist") or []
    todo = [(Requirement(line), "") for line in lines]
    found: dict[str, Distribution] = {}
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        key = f"{canonicalize_name(requirement.name)}{sorted(requirement.extras)}"
        if key not in found:
            found[key] = dist = importlib.metadata.distribution(requirement.name)
            todo += [(Requirement(line), extra) for extra in ("", *requirement.extras) for line in dist.requires or []]
    return list({dist.metadata["Name"]: dist for dist in found.values()}.values())


def fresh_environment(path: Path, wheel: Path, env: dict[str, str]) -> Path:
    """A new virtual environment at ``path`` (without pip: an older copy would shadow this one's) that sees, of this
    environment's packages, only those the wheel requires and pip to install it: a folder of links to their files,
    named in a ``.pth`` file. A module the package imports without declaring it fails there, as in a user's fresh
    environment, without installing torch and its CUDA libraries again (about 6 GB); its python."""
    run([sys.executable, "-m", "venv", "--without-pip", path], path.parent, env)
    python = path / "bin" / "python"
    own = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], path.parent, env).strip())
    linked = path / "dependencies"
    linked.mkdir()
    for dist in [*runtime_requirements(wheel), importlib.metadata.distribution("pip")]:
        for top in {file.parts[0] for file in dist.files or [] if file.parts[0] not in ("..", "__pycache__")}:
            if not (linked / top).exists() and Path(dist.locate_file(top)).exists():
                (linked / top).symlink_to(dist.locate_file(top))
    (own / "dependencies.pth").write_text(f"{linked}\n")
    return python


@pytest.mark.slow
def test_wheel_in_a_fresh_environment_runs_from_anywhere(tmp_path: Path) -> None:
    if not (REAL_DATA / "ml-100k" / "u.data").is_file():
        pytest.skip("../shared/data/ml-100k is not beside the project")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    wheel = build_wheel(tmp_path, env)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"mtmoe/data/manifest.json", "mtmoe/tuning/spaces/movielens-100k.yaml", "mtmoe/lit/module.py"} <= names
    venv = tmp_path / "venv"
    python = fresh_environment(venv, wheel, env)
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", wheel], tmp_path, env)
    run([python, "-m", "pip", "check"], tmp_path, env)  # every requirement of the wheel is installed and fits
    where = "import mtmoe, pathlib; print(pathlib.Path(mtmoe.__file__).parents[1])"
    site_packages = Path(run([python, "-c", where], tmp_path, env).strip())
    assert site_packages.is_relative_to(venv) and (site_packages / "mtmoe" / "run.py").is_file()
    installed = package_files(site_packages)

    # a user's project folder, outside the checkout; caches and HOME in the test's folder
    work = tmp_path / "project"
    work.mkdir()
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", HOME=str(tmp_path / "home"),
               MTMOE_DATA=str(REAL_DATA), MTMOE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    assert "comet" in run(["mtmoe", "gates"], work, env)
    run([python, "-m", "mtmoe", "fit", "--gate", "topk", "--data", "movielens-100k", *TINY], work, env)
    results = json.loads((work / "runs" / "lightning_logs" / "version_0" / "results.json").read_text())
    assert results["gate"] == "topk" and results["test"]["loss"] > 0
    run([python, "-m", "mtmoe", "tune", "--gate", "topk", "--data", "movielens-100k", "--trials", "3", *TINY],
        work, env)
    assert (work / "studies" / "optuna.db").is_file()
    assert len(list((work / "studies" / "runs").rglob("results.json"))) == 3
    report = run([python, "-m", "mtmoe", "report", "--data", "movielens-100k"], work, env)
    assert "| movielens-100k/topk | topk |" in report
    # 3 trials: the objective's exact bands (opda) at 30%; at the default 95% they need 8
    run([python, "-m", "mtmoe", "bootstrap", "--data", "movielens-100k", "--confidence", "0.3"], work, env)
    assert {p.name for p in (work / "studies" / "reports" / "movielens-100k").iterdir()} == {
        "report.md", "table_2_3.csv", "table_7.csv", "bootstrap.png", "bootstrap.pdf", "bootstrap.md", "bootstrap.html",
        "bootstrap_curves.csv", "bootstrap_factors.csv", "bootstrap_ranges.csv", "bootstrap_objective.csv",
        "bootstrap_objective_factors.csv", "bootstrap_parametric.csv", "importance.csv", "importance.png",
        "importance.pdf", "routing.csv"}
    assert {p.name for p in work.iterdir()} == {"runs", "studies"}  # nothing else in the current directory
    assert package_files(site_packages) == installed  # nothing written into the installed package
