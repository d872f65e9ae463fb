"""``tune`` and ``report`` for real: search spaces, planned configurations, SQLite and PostgreSQL studies, several
worker processes, a worker killed with SIGKILL, Ctrl-C, diverged trials, bad input, optuna-dashboard's HTTP API.

Every training is tiny (1-2 epochs of a few batches of the fixture data). PostgreSQL is a throwaway server on
loopback (``postgres_url`` in conftest.py, ``tests/pg.py``); heartbeats are shortened through
``MTMOE_HEARTBEAT_INTERVAL`` / ``MTMOE_HEARTBEAT_GRACE`` so a killed worker's trial goes stale in seconds.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from functools import partial
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState
from scipy.stats import ttest_ind

from mtmoe.errors import UsageError
from mtmoe.tuning import trials as trials_module
from mtmoe.tuning.space import SPACES_DIR, load_space
from mtmoe.tuning.storage import storage_for
from mtmoe.tuning.objective import plan_configurations

from conftest import REAL_DATA, run_cli, write_u_data
from pg import free_port

TINY = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=2",
        "--trainer.limit_test_batches=2", "--data.batch_size=64"]
# 2 epochs of 3 steps (a pack held by tests/sleep_callback.py stays RUNNING, sleeping, until the test lets it go)
SHORT = ["--trainer.max_epochs=2", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2",
         "--trainer.limit_test_batches=2", "--data.batch_size=64"]
SPACE_FILES = sorted(SPACES_DIR.glob("*.yaml"))
# The other papers' routers (not in the COMET paper): their own hyperparameters are the same in every file.
ROUTERS = ("competesmoe", "competesmoe-v2", "sparsemixer", "expertchoice", "usmoe")
optuna.logging.set_verbosity(optuna.logging.WARNING)


def tune_args(storage: str, root: Path, log_dir: Path, *extra: str, trials: int = 3, gate: str = "topk",
              name: str | None = None) -> list[str]:
    args = ["tune", "--gate", gate, "--data", "movielens-100k", "--trials", str(trials), "--storage", storage,
            "--log-dir", str(log_dir), f"--data.root={root}"]
    return args + (["--study-name", name] if name else []) + list(extra)


def trials_of(storage, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


def assert_each_config_once(trials: list[optuna.trial.FrozenTrial], n: int) -> None:
    """Exactly ``n`` complete trials, config_ids 0..n-1 once each, nothing left WAITING or RUNNING."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.user_attrs["config_id"] for t in complete) == list(range(n))
    assert not [t for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)]


def subprocess_env(tmp: Path, root: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "MTMOE_DATA": str(root), "MTMOE_CACHE": str(tmp / "cache"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}  # tiny models: one thread each is faster, and no oversubscription
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return {**env, **extra}


def start_tune(args: list[str], tmp: Path, root: Path, log: str, **env: str) -> subprocess.Popen:
    """``python -m mtmoe ARGS`` in the background, cwd ``tmp``; stdout and stderr to ``tmp/LOG.out|err``."""
    out, err = open(tmp / f"{log}.out", "w"), open(tmp / f"{log}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "mtmoe", *args], cwd=tmp, env=subprocess_env(tmp, root, **env),
                            stdout=out, stderr=err,  # SIGINT as at a terminal, even if pytest runs in the background
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def run_tune(args: list[str], tmp: Path, root: Path, log: str, timeout: int = 300, **env: str) -> tuple[int, str, str]:
    proc = start_tune(args, tmp, root, log, **env)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, (tmp / f"{log}.out").read_text(), (tmp / f"{log}.err").read_text()


def wait_for_running(storage, name: str, proc: subprocess.Popen, tmp: Path, log: str,
                     min_age: float = 1.5, timeout: float = 180, ready=None) -> optuna.trial.FrozenTrial:
    """The first RUNNING trial that is ``ready``: by default, running for at least ``min_age`` seconds (training has
    started: make_cli takes ~1 s)."""
    if ready is None:
        def ready(trial: optuna.trial.FrozenTrial) -> bool:
            return (datetime.now() - trial.datetime_start).total_seconds() >= min_age
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tune ended ({proc.returncode}) before a trial was caught running: "
                        f"{(tmp / f'{log}.err').read_text()[-3000:]}")
        try:
            running = [t for t in trials_of(storage, name) if t.state == TrialState.RUNNING]
        except KeyError:  # the study does not exist yet
            running = []
        except Exception as error:  # a locked SQLite file while the worker writes: look again
            if "locked" not in str(error):
                raise
            running = []
        caught = next((trial for trial in running if ready(trial)), None)
        if caught is not None:
            return caught
        time.sleep(0.2)
    pytest.fail("no trial was caught running")


def interrupt_while_running(args: list[str], tmp: Path, root: Path, storage, name: str, min_age: float = 1.5,
                            signum: int = signal.SIGINT, ready=None,
                            timeout: float = 180) -> tuple[int, str, optuna.trial.FrozenTrial]:
    """Start ``tune``, press Ctrl-C (or send ``signum``) once a trial runs (and is ``ready``,
    :func:`wait_for_running`): its exit code, stderr and the trial caught running."""
    proc = start_tune(args, tmp, root, "first")
    try:
        target = wait_for_running(storage, name, proc, tmp, "first", min_age=min_age, timeout=timeout, ready=ready)
        os.kill(proc.pid, signum)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, (tmp / "first.err").read_text(), target


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models train 2-3x faster with one intra-op thread on a busy machine; restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------- search spaces


@pytest.mark.parametrize("path", SPACE_FILES, ids=lambda p: p.name)
def test_every_gate_has_a_search_space_on_every_dataset(path: Path) -> None:
    """Every registered gate and "+" variant, with a section of the file or without (its own defaults): the file's
    fixed settings, a learning rate, and the local-search window for a "+" variant."""
    import yaml

    from mtmoe.gates import gate_variants

    document = yaml.safe_load(path.read_text())
    assert document["data"] == path.stem and len(document["gates"]) >= 8
    assert document["trials"] in (100, 500)  # S1.3: 500 configurations a gate, 100 for CelebA
    for gate in gate_variants():
        space = load_space(document["data"], gate, path)
        assert space.gate == gate and space.trials == document["trials"]
        assert "model.lr" in space.distributions
        # S1.3: 100 epochs for the recommenders and CelebA, 200 for the other image datasets; patience 25 for all
        assert space.fixed["trainer.max_epochs"] in (100, 200) and space.fixed["early_stopping.patience"] == 25
        assert ("model.perm_epochs" in space.distributions) == gate.endswith("+")


@pytest.mark.parametrize("path", SPACE_FILES, ids=lambda p: p.name)
def test_every_section_names_a_gate_and_tunes_only_its_declared_hyperparameters(path: Path) -> None:
    """A section per gate or "+" variant that has one; ``model.gate.*`` distributions only over the gate's declared
    ``search_space``."""
    import yaml

    from mtmoe.gates import gate_class, gate_variants

    sections = set(yaml.safe_load(path.read_text())["gates"])
    assert sections <= set(gate_variants())
    for gate in sections:
        space = load_space(path.stem, gate, path)
        tuned = {k.removeprefix("model.gate.") for k in space.distributions if k.startswith("model.gate.")}
        assert tuned <= set(gate_class(gate.removesuffix("+")).search_space), gate


def dataset_info(data: str):
    """The dataset's :class:`DatasetInfo`, from its DataModule's constructor alone (no data is read)."""
    import importlib

    from mtmoe.data import DATASETS

    module_name, class_name = DATASETS[data].rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)(download=False).info


def own_settings(space) -> dict:
    """A section's ``model.*`` values and distributions but the learning rate, k and n: what a router's papers set."""
    entries = {**space.fixed, **space.distributions}
    return {key: value for key, value in entries.items()
            if key.startswith("model.") and key not in ("model.lr", "model.gate.k", "model.n_experts")}


def routers_and_plus() -> list[str]:
    """The other papers' routers, each followed by its "+" where local search may permute its weights."""
    from mtmoe.gates import gate_class

    return [g for base in ROUTERS for g in (base, base + "+") if g == base or gate_class(base).permutable]


@pytest.mark.parametrize("path", SPACE_FILES, ids=lambda p: p.name)
def test_router_sections_take_movielens_hyperparameters_with_the_files_lr_and_k(path: Path) -> None:
    """The routers' own hyperparameters come from their papers (cited in movielens.yaml), so they are the same in
    every file; the learning rate is the file's Top-k's, k the dataset's (Expert Choice's capacity factor: the
    paper's 1 and 2, and the dataset's k), and a "+" section adds movielens.yaml's local-search window."""
    info = dataset_info(path.stem)
    topk = load_space(path.stem, "topk", path)
    assert topk.fixed["model.gate.k"] == info.k
    for gate in routers_and_plus():
        space = load_space(path.stem, gate, path)
        reference = load_space("movielens", gate, SPACES_DIR / "movielens.yaml")
        assert own_settings(space) == own_settings(reference), gate
        assert space.distributions["model.lr"] == topk.distributions["model.lr"], gate
        if gate.removesuffix("+") == "expertchoice":
            assert space.distributions["model.gate.k"] == CategoricalDistribution(sorted({1, 2, info.k}))
        elif "model.gate.k" in {*reference.fixed, *reference.distributions}:
            assert space.fixed["model.gate.k"] == info.k, gate


@pytest.mark.parametrize("path", SPACE_FILES, ids=lambda p: p.name)
def test_every_space_builds_the_datasets_model_and_every_gate_value_routes(path: Path) -> None:
    """Tune's first configuration of every gate's space builds the dataset's model (the CLI's ``model.*`` arguments,
    no data read), and every value of every ``model.gate.*`` hyperparameter builds that model's gate, which routes
    a random batch: weights ``[B, n]``, finite and non-negative, a finite auxiliary loss."""
    import torch

    from mtmoe.gates import RoutingInput, create_gate, gate_class, gate_variants
    from mtmoe.lit.module import MultiTaskMoE
    from mtmoe.pack.settings import ModelSettings
    from mtmoe.random import Stream

    info, batch = dataset_info(path.stem), 16
    torch.manual_seed(0)
    for gate in gate_variants():
        space = load_space(path.stem, gate, path)
        assert space.fixed["model.n_experts"] == info.n_experts  # the paper's n (S1.2), as the DataModule's
        (first,) = plan_configurations(space, 1, 0)
        settings = {**space.fixed, **first}
        gate_args = {k.removeprefix("model.gate."): v for k, v in settings.items() if k.startswith("model.gate.")}
        model_args = {k.removeprefix("model."): v for k, v in settings.items()
                      if k.startswith("model.") and not k.startswith("model.gate.")}
        base = gate.removesuffix("+")
        model = MultiTaskMoE.build(info, ModelSettings(gate=partial(gate_class(base), **gate_args), **model_args))
        assert (model.net.local_search is not None) == gate.endswith("+")
        dims = model.net.gates[0].dims
        assert len(model.net.gates) == len(info.tasks) and dims.n_experts == info.n_experts
        for key, distribution in space.distributions.items():
            if not key.startswith("model.gate."):
                continue
            categorical = isinstance(distribution, CategoricalDistribution)
            for value in distribution.choices if categorical else (distribution.low, distribution.high):
                router = create_gate(base, dims, **{**gate_args, key.removeprefix("model.gate."): value})
                routing = RoutingInput(x=torch.randn(batch, dims.in_features),
                                       sample_id=torch.randint(dims.n_ids, (batch,)),
                                       expert_outputs=torch.randn(batch, dims.n_experts, *dims.expert_shape),
                                       stream=Stream(torch.tensor(0), torch.tensor(0)))
                output = router(routing)
                assert output.weights.shape == (batch, dims.n_experts), (gate, key, value)
                assert torch.isfinite(output.weights).all() and (output.weights >= 0).all(), (gate, key, value)
                assert torch.isfinite(output.aux_loss), (gate, key, value)


BASE_SPACE = """\
data: movielens-100k
trials: 10
fixed:
  data.batch_size: 64
gates:
  comet:
    model.lr: {log_uniform: [5.0e-5, 5.0e-4]}
    model.gate.gamma: {choice: [0.01, 0.1, 1, 5, 10]}
"""


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("model.gate.gamma:", "model.gate.gama:", "unknown key 'model.gate.gama'"),
        ("data.batch_size:", "data.batch_sise:", "unknown key 'data.batch_sise'"),
        ("{choice: [0.01, 0.1, 1, 5, 10]}", "{choice: []}", "choice needs a non-empty list"),
        ("[5.0e-5, 5.0e-4]", "[5.0e-4, 5.0e-5]", "empty or invalid range"),
        ("  comet:\n", "  cometx:\n", "section 'cometx' names no registered gate (gates: comet, "),
        ("trials: 10", "trails: 10", "top-level keys must be"),
        ("{log_uniform:", "{loguniform:", "must be a value or one of"),
        ("{choice: [0.01, 0.1, 1, 5, 10]}", "{int: [1, 10.5]}", "int needs [low, high] (integers)"),
        ("[5.0e-5, 5.0e-4]", "[0, 5.0e-4]", "empty or invalid range [0, 0.0005] for log_uniform"),
    ],
)
def test_bad_search_space_names_the_problem(tmp_path: Path, old: str, new: str, message: str) -> None:
    path = tmp_path / "space.yaml"
    assert old in BASE_SPACE
    path.write_text(BASE_SPACE.replace(old, new))
    with pytest.raises(UsageError, match=re.escape(message)):
        load_space("movielens-100k", "comet", path)
    path.write_text(BASE_SPACE)
    assert load_space("movielens-100k", "comet", path).trials == 10  # the unbroken file loads


def test_plan_is_reproducible_and_inside_the_space() -> None:
    space = load_space("movielens-100k", "comet+", SPACES_DIR / "movielens-100k.yaml")
    first, again, other = (plan_configurations(space, 20, seed) for seed in (0, 0, 1))
    assert first == again and first != other and len(first) == 20
    for configuration in first + other:
        assert set(configuration) == set(space.distributions)
        for key, value in configuration.items():
            distribution = space.distributions[key]
            assert distribution._contains(distribution.to_internal_repr(value)), (key, value)
    assert len({c["model.lr"] for c in first}) == 20  # really random draws, not one value repeated
    assert plan_configurations(space, 5, 0) == first[:5]  # a longer study extends a shorter one


# --------------------------------------------------------------------------------------------- SQLite, in-process


def test_sqlite_study_resume_reproducible_and_report(tiny_root: Path, tmp_path: Path, capsys) -> None:
    url, logs = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "runs"
    args = tune_args(url, tiny_root, logs, "--trainer.max_epochs=2", *TINY[1:], trials=3)
    assert run_cli(args) == 0
    out, err = capsys.readouterr()
    assert "%|" not in err and "\r" not in out + err  # not a terminal: plain lines, no bar
    assert re.search(r"^\[movielens-100k/topk\] 3/3 done, 0 failed, best \d+\.\d+, 0 running in a pack of [123], pack epoch \d+ done, "
                     r"elapsed \S+, ETA \S+$", out, re.M), out
    trials = trials_of(url, "movielens-100k/topk")
    assert len(trials) == 3
    assert_each_config_once(trials, 3)
    for trial in trials:
        attrs = trial.user_attrs
        for key in ("test_loss", "test/watch/auroc", "test/rating/mse", "test/watch/experts_per_sample",
                    "epochs_run", "wall_time_s", "seed", "config_hash"):
            assert key in attrs, key
        assert attrs["seed"] == attrs["config_id"] and attrs["epochs_run"] == 2 and attrs["device"] == "cpu"
        assert attrs["test/watch/experts_per_sample"] == pytest.approx(2.0)  # top-2
        assert math.isfinite(attrs["test_loss"]) and 0.0 <= attrs["test/watch/auroc"] <= 1.0
        # the objective is the best epoch's validation loss, as logged by that trial's run
        metrics = pd.read_csv(next((logs / "movielens-100k_topk" / f"config-{attrs['config_id']:04d}")
                                   .rglob("metrics.csv")))
        val = metrics["val/loss"].dropna()
        assert len(val) == 2 and trial.value == pytest.approx(val.min(), rel=1e-6)
        assert attrs["best_epoch"] == int(metrics.loc[val.idxmin(), "epoch"])
    assert len({t.user_attrs["config_hash"] for t in trials}) == 3

    assert run_cli(args) == 0  # a rerun evaluates nothing new
    assert len(trials_of(url, "movielens-100k/topk")) == 3

    other = f"sqlite:///{tmp_path / 'other.db'}"  # the same seed elsewhere: the same configurations
    assert run_cli(tune_args(other, tiny_root, tmp_path / "runs2", *TINY, trials=3)) == 0
    params = lambda u: {t.user_attrs["config_id"]: t.params for t in trials_of(u, "movielens-100k/topk")}
    assert params(url) == params(other)
    assert len({p["model.lr"] for p in params(url).values()}) == 3

    # report on the real study: 3 trials -> the top 5% is the one with the best validation loss
    capsys.readouterr()
    assert run_cli(["report", "--data", "movielens-100k", "--storage", url, "--out", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    best = min(trials, key=lambda t: t.value)
    row = pd.read_csv(tmp_path / "rep" / "table_2_3.csv").iloc[0]
    assert row.study == "movielens-100k/topk" and row.trials == 3 and row.selected == 1
    assert row.test_loss_x100_mean == pytest.approx(100 * best.user_attrs["test_loss"])
    ns = np.mean([best.user_attrs["test/watch/experts_per_sample"], best.user_attrs["test/rating/experts_per_sample"]])
    assert row.n_s_mean == pytest.approx(ns)
    table7 = pd.read_csv(tmp_path / "rep" / "table_7.csv").iloc[0]
    assert table7["watch AUC mean"] == pytest.approx(100 * best.user_attrs["test/watch/auroc"])
    assert table7["rating MSE mean"] == pytest.approx(best.user_attrs["test/rating/mse"])
    assert f"{100 * best.user_attrs['test_loss']:.2f} ± n/a" in printed
    assert "Test loss ×10⁻², as the paper writes it: in hundredths" in printed and "(×100)" not in printed
    assert (tmp_path / "rep" / "report.md").read_text() in printed
    assert "| - | cpu ×3 |" in printed  # the Studies table: no failed configuration, what trained the trials


def test_trained_on_counts_each_device_and_its_plain_kernels() -> None:
    from mtmoe.tuning.trials import trained_on

    rows = pd.DataFrame({"device": ["", "", "NVIDIA H200", "NVIDIA H200", "NVIDIA H100 80GB HBM3"],
                         "plain_kernels": ["", "", "", "epilogue,mixing", ""], "code": ""})
    assert trained_on(rows) == ("not recorded ×2; NVIDIA H200 ×1; NVIDIA H200, plain epilogue,mixing ×1; "
                                "NVIDIA H100 80GB HBM3 ×1")
    assert trained_on(rows.iloc[:2]) == "-"  # a study from before the device was recorded
    rows["code"] = "5252e5a"
    assert "code" not in trained_on(rows)  # one code: not named
    rows["code"] = ["", "", "5252e5a", "5252e5a", "5252e5a"]
    assert trained_on(rows).startswith("not recorded, code not recorded ×2; NVIDIA H200, code 5252e5a ×1;")
    rows.loc[4, "code"] = "9e35c08"  # a study resumed under other code: each trial's is named
    assert trained_on(rows) == ("not recorded, code not recorded ×2; NVIDIA H200, code 5252e5a ×1; "
                                "NVIDIA H200, plain epilogue,mixing, code 5252e5a ×1; NVIDIA H100 80GB HBM3, code 9e35c08 ×1")


def test_the_code_version_is_the_environments_else_gits_else_the_installed_version(monkeypatch,
                                                                                  tmp_path: Path) -> None:
    """``code_version``: ``$MTMOE_CODE`` (a lent GPU's copy of a checkout: its git history may be stale), else this
    checkout's ``git describe`` (the CI's clean clone: a commit), else the installed version."""
    import subprocess

    import mtmoe.code_version as code

    try:
        monkeypatch.setenv(code.ENVIRONMENT, "5252e5a")
        code.code_version.cache_clear()
        assert code.code_version() == "5252e5a"
        monkeypatch.delenv(code.ENVIRONMENT)
        code.code_version.cache_clear()
        root = Path(code.__file__).resolve().parent.parent
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True)
        if (root / ".git").exists() and git.returncode == 0:
            assert code.code_version() == git.stdout.strip() and code.code_version() != ""
        code.code_version.cache_clear()
        monkeypatch.setattr(code, "__file__", str(tmp_path / "mtmoe" / "code_version.py"))  # no checkout around it
        assert code.code_version() == code.version("mtmoe")
    finally:
        code.code_version.cache_clear()


def test_router_names_with_hyphens_and_plus_flow_through_tune_and_report(tiny_root: Path, tmp_path: Path,
                                                                         capsys) -> None:
    """``competesmoe-v2`` and ``usmoe+`` (a boolean hyperparameter, a "+" variant) from the real search spaces."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    for gate in ("competesmoe-v2", "usmoe+"):
        extra = ["--model.perm_epochs=1"] if gate.endswith("+") else []
        assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *TINY, *extra, trials=1, gate=gate)) == 0
        (trial,) = trials_of(url, f"movielens-100k/{gate}")
        assert trial.state == TrialState.COMPLETE and math.isfinite(trial.user_attrs["test_loss"])
    assert isinstance(trial.params["model.gate.rescale_expert_choice"], bool)
    capsys.readouterr()
    assert run_cli(["report", "--data", "movielens-100k", "--storage", url, "--out", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    table = pd.read_csv(tmp_path / "rep" / "table_2_3.csv").set_index("study")
    assert list(table.gate) == ["competesmoe-v2", "usmoe+"]
    assert table.loc["movielens-100k/usmoe+"].baseline == "movielens-100k/competesmoe-v2"  # "+" is never a baseline
    assert pd.isna(table.loc["movielens-100k/competesmoe-v2"].baseline)
    assert "| movielens-100k/competesmoe-v2 | competesmoe-v2 |" in printed and "| movielens-100k/usmoe+ | usmoe+ |" in printed


ODD_LR_SPACE = """\
data: movielens-100k
trials: 3
fixed:
  model.n_experts: 16
gates:
  topk:
    model.lr: {{choice: [1.0e-3, {odd}]}}
    model.gate.k: 2
"""


def space_with_one_odd_lr(folder: Path, odd: float) -> tuple[Path, int]:
    """A topk space file choosing the learning rate 1e-3 or ``odd``, and a seed whose 3 configurations take ``odd``
    once: (its path, the seed)."""
    path = folder / "odd-lr.yaml"
    path.write_text(ODD_LR_SPACE.format(odd=f"{odd:.1e}"))  # YAML reads 1e+30 as text, 1.0e+30 as a number
    space = load_space("movielens-100k", "topk", path)
    return path, next(s for s in range(50) if sorted(c["model.lr"] for c in plan_configurations(space, 3, s)) ==
                      [1e-3, 1e-3, odd])


@pytest.mark.filterwarnings("ignore:Encountered `nan` values")
def test_diverged_trial_is_failed_with_reason_and_not_retried(tiny_root: Path, tmp_path: Path, capsys) -> None:
    space_path, seed = space_with_one_odd_lr(tmp_path, 1e30)  # two sane configurations, one that must blow up
    url = f"sqlite:///{tmp_path / 'nan.db'}"
    args = tune_args(url, tiny_root, tmp_path / "runs", *TINY, "--space", str(space_path), "--seed", str(seed))
    assert run_cli(args) == 0
    out, err = capsys.readouterr()
    assert "%|" not in err and "\r" not in out + err  # not a terminal: plain lines, no bar
    assert re.search(r"^\[movielens-100k/topk\] 3/3 done, 1 failed, best \d", out, re.M), out
    trials = trials_of(url, "movielens-100k/topk")
    diverged = [t for t in trials if t.state == TrialState.FAIL]
    assert f"trial {diverged[0].number} (config_id {diverged[0].user_attrs['config_id']}) failed: diverged: " in out
    assert "best nan" not in out
    assert len(diverged) == 1 and diverged[0].params["model.lr"] == 1e30
    assert diverged[0].user_attrs["fail_reason"].startswith("diverged: ")
    assert "nan" in diverged[0].user_attrs["fail_reason"] or "inf" in diverged[0].user_attrs["fail_reason"]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 2 and all(t.params["model.lr"] == 1e-3 for t in complete)

    assert run_cli(args) == 0  # the rerun does not retry a diverged configuration
    assert len(trials_of(url, "movielens-100k/topk")) == 3

    # in the report it counts among the n with objective +inf: never selected while a finite trial is left
    rows = trials_module.trial_rows("s", {"gate": "topk"}, trials)
    assert len(rows) == 3 and [r["objective"] for r in rows if r["failed"]] == [math.inf]


def test_journal_storage_fails_trials_of_dead_local_workers_and_re_enqueues(tmp_path: Path) -> None:
    """JournalStorage has no heartbeats: a RUNNING trial whose worker process on this host is gone is failed when
    ``tune`` prepares the study again, and its configuration is enqueued again; a live worker's trial is kept."""
    from mtmoe.tuning.study import prepare_study

    space = load_space("movielens-100k", "topk")
    configurations = plan_configurations(space, 3, 0)
    url = f"journal:{tmp_path / 'j.log'}"
    prepare_study(url, "j", space, 0, configurations)
    storage = storage_for(url)
    study = optuna.load_study(study_name="j", storage=storage)
    dead = subprocess.Popen(["true"])
    dead.wait()
    lost, alive = study.ask(), study.ask()  # configurations 0 and 1, as two workers would pop them
    host = socket.gethostname()
    lost.set_user_attr("worker", f"{host}:{dead.pid}")
    alive.set_user_attr("worker", f"{host}:{os.getpid()}")
    prepare_study(url, "j", space, 0, configurations)  # what a rerun of tune does first
    trials = trials_of(storage, "j")
    by_number = {t.number: t for t in trials}
    assert by_number[lost.number].state == TrialState.FAIL and "lost" in by_number[lost.number].user_attrs
    assert by_number[alive.number].state == TrialState.RUNNING
    waiting = sorted(t.user_attrs["config_id"] for t in trials if t.state == TrialState.WAITING)
    assert waiting == [0, 2]  # config 0 again (lost), config 2 still waiting; config 1 is running


def test_a_configuration_enqueued_twice_runs_once() -> None:
    from mtmoe.tuning.objective import duplicate_of

    study = optuna.create_study()
    for _ in range(2):
        study.enqueue_trial({"x": 1.0}, user_attrs={"config_id": 7})
    study.enqueue_trial({"x": 2.0}, user_attrs={"config_id": 8})
    first, second = study.ask(), study.ask()  # both copies of config 7 popped by two workers
    assert duplicate_of(study, first.number, 7) is None  # the lowest-numbered copy runs
    assert duplicate_of(study, second.number, 7) == first.number  # the other one is skipped
    study.tell(first, 0.5)
    assert duplicate_of(study, second.number, 7) == first.number  # and stays skipped once the first completed
    assert duplicate_of(study, study.ask().number, 8) is None


# ------------------------------------------------------------------------------------------------------ bad input


def file_digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"gate": "nope"}, "unknown gate 'nope'"),
        ({"data": "nope"}, "unknown dataset 'nope'"),
        ({"space": BASE_SPACE.replace("model.gate.gamma:", "model.gate.gama:")}, "unknown key 'model.gate.gama'"),
        ({"space": BASE_SPACE.replace("[0.01, 0.1, 1, 5, 10]", "[]")}, "choice needs a non-empty list"),
        ({"trials": "0"}, "--trials must be between 1 and 100000"),
        ({"storage": "postgresql+psycopg2://mtmoe@127.0.0.1:1/nowhere"}, "cannot open the study storage"),
        ({"storage": "postgresql://mtmoe@127.0.0.1:1/nowhere"}, "Connection refused"),
        ({"storage": "sqlite:////nonexistent-dir/s.db"}, "there is no folder /nonexistent-dir for its file"),
        ({"workers": "2"}, "SQLite serialises writers"),
        ({"gate": "comet+", "extra": ["--trainer.max_epochs=1"]}, "longer than the run"),
        ({"extra": ["--model.lr=abc"]}, "model.lr"),
        ({"space": BASE_SPACE + "    model.gate.k: {int: [1, 20]}\n"},
         "the search space's model.gate.k may be 20, which is not allowed: k must satisfy 1 <= k <= n_experts = 16; "
         "narrow its range in the search space (--space), or pass --model.gate.k VALUE to fix it"),
        ({"space": BASE_SPACE.replace("[0.01, 0.1, 1, 5, 10]", "[0.01, 0]")}, "the search space's "
         "model.gate.gamma may be 0, which is not allowed: gamma must be > 0"),
        ({"space": BASE_SPACE + "    data.eval_batch_size: {choice: [64, 0]}\n"},
         "the search space's data.eval_batch_size may be 0, which is not allowed: eval_batch_size must be >= 1"),
        ({"space": BASE_SPACE + "    model.n_experts: {choice: [16, 2]}\n    model.gate.k: 4\n"},
         "model.gate.k 4 is not allowed: k must satisfy 1 <= k <= n_experts = 2"),
        ({"extra": ["--model.gate.k=20"]}, "--model.gate.k 20 is not allowed: k must satisfy 1 <= k <= n_experts = 16; "
                                          "pass another --model.gate.k, or change --model.n_experts"),
        ({"extra": ["--space=."]}, ". is a folder, not a search-space file for dataset 'movielens-100k': pass "
                                   "--space FILE.yaml (the packaged ones: "),
        ({"extra": ["--space=missing.yaml"]}, "no search-space file missing.yaml for dataset 'movielens-100k': pass "
                                              "--space FILE.yaml"),
    ],
    ids=["gate", "dataset", "space-typo", "empty-grid", "trials-0", "unreachable-pg", "plain-postgresql-url",
         "unreachable-sqlite", "sqlite-workers", "perm-window", "bad-override", "planned-k", "planned-gamma",
         "planned-batch-size", "bounded-k", "override-k", "space-folder", "space-missing"],
)
def test_bad_input_one_line_exit_2_storage_untouched(tiny_root: Path, tmp_path: Path, capsys, change, message):
    db = tmp_path / "untouched.db"
    argv = ["tune", "--gate", change.get("gate", "comet"), "--data", change.get("data", "movielens-100k"),
            "--trials", change.get("trials", "2"), "--storage", change.get("storage", f"sqlite:///{db}"),
            "--log-dir", str(tmp_path / "runs"), f"--data.root={tiny_root}", *TINY, *change.get("extra", [])]
    if "space" in change:
        (tmp_path / "bad.yaml").write_text(change["space"])
        argv += ["--space", str(tmp_path / "bad.yaml")]
    if "workers" in change:
        argv += ["--workers", change["workers"]]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not db.exists() and not (tmp_path / "runs").exists()


def test_study_name_with_another_space_is_refused(tiny_root: Path, tmp_path: Path, capsys) -> None:
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs", *TINY, trials=1, gate="comet", name="shared")) == 0
    before_trials = [(t.number, t.state, t.params) for t in trials_of(url, "shared")]
    before_attrs = optuna.load_study(study_name="shared", storage=url).user_attrs
    digest = file_digest(db)
    capsys.readouterr()
    (tmp_path / "other.yaml").write_text(BASE_SPACE)  # comet with a narrower space than studies/movielens-100k.yaml
    argv = tune_args(url, tiny_root, tmp_path / "runs", *TINY, "--space", str(tmp_path / "other.yaml"), trials=1,
                     gate="comet", name="shared")
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists with other settings (search space " in err[0], err
    assert file_digest(db) == digest
    assert [(t.number, t.state, t.params) for t in trials_of(url, "shared")] == before_trials
    assert optuna.load_study(study_name="shared", storage=url).user_attrs == before_attrs
    assert run_cli([*tune_args(url, tiny_root, tmp_path / "runs", *TINY, trials=1, gate="comet", name="shared"),
                    "--seed", "1"]) == 2  # another seed: other configurations, refused too
    assert file_digest(db) == digest


# ---------------------------------------------------------------------------------------------------- Ctrl-C (SQLite)


# ----------------------------------------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="module")
def pg_study(postgres_url: str, tmp_path_factory) -> tuple[str, str, Path]:
    """A 6-configuration study of comet (three hyperparameters) run by ``tune --workers 3`` (three processes) on
    PostgreSQL."""
    tmp = tmp_path_factory.mktemp("workers")
    root = tmp / "data"
    write_u_data(root)
    name = "three-workers"
    args = tune_args(postgres_url, root, tmp / "runs", *TINY, "--workers", "3", trials=6, gate="comet", name=name)
    code, out, err = run_tune(args, tmp, root, "workers")
    assert code == 0, err[-3000:]
    return postgres_url, name, tmp


@pytest.mark.integration
def test_three_workers_on_postgres_evaluate_each_configuration_once(pg_study) -> None:
    url, name, tmp = pg_study
    trials = trials_of(url, name)
    assert_each_config_once(trials, 6)
    planned = [t for t in trials if "config_id" in t.user_attrs and t.state != TrialState.PRUNED]
    assert len(planned) == 6  # no second evaluation of any configuration, no failure
    out = (tmp / "workers.out").read_text()
    assert "3 worker(s)" in out and re.search(r"\[three-workers\] 6/6 done, 0 failed", out), out
    done = [int(n) for n in re.findall(r"^\[three-workers\] (\d)/6 done, .*, pack epoch \d+ done, ", out, re.M)]
    # each worker prints when its trials end (a pack's may end together; three processes may repeat a count), and
    # as its first pack epoch starts (0/6 done, ..., pack epoch 1 0%)
    assert len(done) >= 3 and max(done) == 6 and min(done) >= 1
    err = (tmp / "workers.err").read_text()
    assert "Traceback" not in err and "GPU available" not in err  # spawned workers are as quiet as one
    workers = {t.user_attrs["worker"] for t in trials if t.state == TrialState.COMPLETE}
    assert all(w.rpartition(":")[2].isdigit() for w in workers) and 1 <= len(workers) <= 3
    # the same plan as one worker would have: the configurations depend on the seed only
    space = load_space("movielens-100k", "comet")
    plan = plan_configurations(type(space)(space.data, space.gate, 6, space.fixed, space.distributions), 6, 0)
    assert {t.user_attrs["config_id"]: t.params for t in trials} == dict(enumerate(plan))


def test_optuna_dashboard_serves_the_trials(pg_study, tmp_path: Path) -> None:
    """The objective by its name (issue 14.10: not "Objective 0"), every trial's hyperparameters as parameters (the
    trial table's columns: the union of the trials' search spaces; the plots': their intersection)."""
    url, name, _ = pg_study
    hyperparameters = sorted(load_space("movielens-100k", "comet").distributions)
    trials = {t.number: t for t in trials_of(url, name)}
    port = free_port()
    dashboard = Path(sys.executable).with_name("optuna-dashboard")
    log = open(tmp_path / "dashboard.log", "w")
    proc = subprocess.Popen([str(dashboard), url, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def get(path: str) -> dict:
        with urllib.request.urlopen(base + path, timeout=10) as response:
            assert response.status == 200
            return json.load(response)

    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                studies = get("/api/studies")["study_summaries"]
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()
                assert time.monotonic() < deadline, "optuna-dashboard did not answer"
                time.sleep(0.3)
        study = next(s for s in studies if s["study_name"] == name)
        attrs = {a["key"]: a["value"] for a in study["user_attrs"]}
        assert attrs["data"] == "movielens-100k" and attrs["gate"] == "comet"
        assert json.loads(attrs["settings"]) == {"data.batch_size": 64, "trainer.limit_test_batches": 2,
                                                 "trainer.limit_train_batches": 5, "trainer.limit_val_batches": 2,
                                                 "trainer.max_epochs": 1}
        detail = get(f"/api/studies/{study['study_id']}")
        assert detail["name"] == name and detail["objective_names"] == ["val_loss"]
        for space in ("union_search_space", "intersection_search_space"):
            assert sorted(entry["name"] for entry in detail[space]) == hyperparameters, space
        served = [t for t in detail["trials"] if t["state"] == "Complete"]
        assert len(detail["trials"]) == len(trials) and len(served) == 6
        for entry in served:
            stored = trials[entry["number"]]
            assert stored.state == TrialState.COMPLETE
            served_params = {p["name"]: p["param_external_value"] for p in entry["params"]}
            assert sorted(served_params) == hyperparameters
            assert {k: float(v) for k, v in served_params.items()} == pytest.approx(stored.params)
            user = {a["key"]: a["value"] for a in entry["user_attrs"]}
            assert int(user["config_id"]) == stored.user_attrs["config_id"]
            assert float(user["test_loss"]) == pytest.approx(stored.user_attrs["test_loss"])
        best = min((t for t in trials.values() if t.state == TrialState.COMPLETE), key=lambda t: t.value)
        assert [b["number"] for b in detail["best_trials"]] == [best.number]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


# ----------------------------------------------------------------------------------------------------------- report


def synthetic_study(storage, name: str, gate: str, n: int, loss: float, rng, diverged: int = 0,
                    data: str = "movielens-100k") -> None:
    study = optuna.create_study(study_name=name, storage=storage)
    study.set_user_attr("data", data)
    study.set_user_attr("gate", gate)
    distribution = optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)
    for config_id in range(n):
        objective = loss + rng.normal(0, 0.01)
        attrs = {"config_id": config_id, "test_loss": objective + rng.normal(0, 0.005),
                 "test/watch/auroc": rng.uniform(0.6, 0.8), "test/rating/mse": rng.uniform(0.8, 1.0),
                 "test/watch/experts_per_sample": rng.uniform(1, 2), "test/rating/experts_per_sample": 2.0}
        if config_id < diverged:
            attrs["fail_reason"] = "diverged: train loss nan at epoch 3"
            attrs["test_loss"] = math.nan
            trial = optuna.trial.create_trial(state=TrialState.FAIL, params={"model.lr": 1e-4},
                                              distributions={"model.lr": distribution}, user_attrs=attrs)
        else:
            trial = optuna.trial.create_trial(value=objective, params={"model.lr": 1e-4},
                                              distributions={"model.lr": distribution}, user_attrs=attrs)
        study.add_trial(trial)
    # noise the report must ignore: a lost trial (crash), a skipped duplicate, a trial of no configuration
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"config_id": n - 1}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={"config_id": 0}))
    study.add_trial(optuna.trial.create_trial(value=-100.0, user_attrs={"test_loss": -100.0}))


def test_report_matches_a_manual_pandas_computation(tmp_path: Path, capsys) -> None:
    url = f"journal:{tmp_path / 'synthetic.log'}"  # JournalStorage: many trials written fast
    storage = storage_for(url)
    rng = np.random.default_rng(0)
    gates = {"movielens-100k/softmax": ("softmax", 0.430, 0), "movielens-100k/topk": ("topk", 0.420, 5),
             "movielens-100k/comet": ("comet", 0.410, 0), "movielens-100k/comet+": ("comet+", 0.370, 45)}
    for name, (gate, loss, diverged) in gates.items():
        synthetic_study(storage, name, gate, 60, loss, rng, diverged)
    synthetic_study(storage, "movielens/topk", "topk", 10, 0.3, rng, data="movielens")  # not in this report
    # another alpha (read from the study name): its own comparison group, never the baseline of alpha's default
    synthetic_study(storage, "movielens-100k/topk/alpha=0.1", "topk", 20, 0.2, rng)
    out = tmp_path / "rep"
    assert run_cli(["report", "--data", "movielens-100k", "--storage", url, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = pd.read_csv(out / "table_2_3.csv").set_index("study")
    table7 = pd.read_csv(out / "table_7.csv").set_index("study")
    assert sorted(table.index) == sorted([*gates, "movielens-100k/topk/alpha=0.1"])
    other_alpha = table.loc["movielens-100k/topk/alpha=0.1"]
    assert other_alpha.alpha == 0.1 and other_alpha.selected == 1 and pd.isna(other_alpha.baseline)

    manual = {}
    for name in gates:
        frame = pd.DataFrame([{**t.user_attrs, "value": t.value, "state": t.state} for t in trials_of(storage, name)])
        frame = frame[frame.config_id.notna() & frame.state.isin([TrialState.COMPLETE, TrialState.FAIL])]
        reason = frame.get("fail_reason", pd.Series("", index=frame.index)).fillna("")
        frame = frame[(frame.state == TrialState.COMPLETE) | reason.str.startswith("diverged")]
        frame["objective"] = np.where(frame.state == TrialState.COMPLETE, frame.value, np.inf)
        assert len(frame) == 60
        top = frame.nsmallest(math.ceil(0.05 * 60), "objective")  # 3 of 60
        manual[name] = top
        row = table.loc[name]
        assert row.trials == 60 and row.selected == 3
        assert row.test_loss_x100_mean == pytest.approx(100 * top.test_loss.mean())
        assert row.test_loss_x100_se == pytest.approx(100 * top.test_loss.std(ddof=1) / math.sqrt(3))
        ns = (top["test/watch/experts_per_sample"] + top["test/rating/experts_per_sample"]) / 2
        assert row.n_s_mean == pytest.approx(ns.mean()) and row.n_s_se == pytest.approx(ns.std(ddof=1) / math.sqrt(3))
        assert table7.loc[name, "watch AUC mean"] == pytest.approx(100 * top["test/watch/auroc"].mean())
        assert table7.loc[name, "rating MSE se"] == pytest.approx(top["test/rating/mse"].std(ddof=1) / math.sqrt(3))
    assert table.loc["movielens-100k/topk"].failed == 5
    # comet+ diverged 45 of 60 times: the 15 finite ones remain, so none of the +inf ones is selected
    assert manual["movielens-100k/comet+"].objective.max() < math.inf
    # the baseline of every gate is the best non-"+" other gate; the Welch one-sided p-values match scipy's
    assert table.loc["movielens-100k/comet+"].baseline == "movielens-100k/comet"
    assert table.loc["movielens-100k/comet"].baseline == "movielens-100k/topk"
    assert table.loc["movielens-100k/softmax"].baseline == "movielens-100k/comet"
    for name in gates:
        baseline = table.loc[name].baseline
        p = ttest_ind(manual[name].test_loss, manual[baseline].test_loss, alternative="less", equal_var=False).pvalue
        assert table.loc[name].p_value == pytest.approx(p)
        assert bool(table.loc[name].significant) == (p < 0.05)
    assert table.loc["movielens-100k/comet+"].significant and not table.loc["movielens-100k/softmax"].significant
    comet_plus = table.loc["movielens-100k/comet+"]
    assert f"*{comet_plus.test_loss_x100_mean:.2f} ± {comet_plus.test_loss_x100_se:.2f}" in printed
    with open(out / "table_2_3.csv") as handle:
        assert next(csv.reader(handle))[:3] == ["study", "gate", "alpha"]
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporary files


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "movielens"], "no studies for dataset 'movielens'"),
        (["--data", "movielens100k"], "(its studies are of movielens-100k; did you mean movielens-100k?)"),
        (["--data", "movielens-100k", "--storage", "postgresql+psycopg2://x@127.0.0.1:1/db"],
         "cannot open the study storage"),
        (["--data", "movielens-100k", "--storage", "sqlite:///{tmp}/missing.db"], "no study storage at"),
        (["--data", "movielens-100k", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_report_bad_input_one_line_exit_2(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    url = f"sqlite:///{tmp_path / 'synthetic.db'}"
    synthetic_study(url, "movielens-100k/topk", "topk", 5, 0.4, np.random.default_rng(1))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--storage" not in argv:
        argv += ["--storage", url]
    assert run_cli(["report", *argv, "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "rep").exists() and not (tmp_path / "missing.db").exists()


@pytest.mark.slow
def test_real_movielens_100k_small_study_and_report(tmp_path: Path, monkeypatch, capsys) -> None:
    """CI's small real study: MovieLens-100K from ../shared/data, 2 configurations of comet, 1 short epoch each."""
    if not (REAL_DATA / "ml-100k" / "u.data").exists():
        pytest.skip("../shared/data/ml-100k is not beside the project")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MTMOE_CACHE", str(tmp_path / "cache"))
    url = f"sqlite:///{tmp_path / 'real.db'}"
    assert run_cli(["tune", "--gate", "comet", "--data", "movielens-100k", "--trials", "2", "--storage", url,
                    "--log-dir", str(tmp_path / "runs"), f"--data.root={REAL_DATA}", "--trainer.max_epochs=1",
                    "--trainer.limit_train_batches=20", "--trainer.limit_val_batches=5",
                    "--trainer.limit_test_batches=5"]) == 0
    trials = trials_of(url, "movielens-100k/comet")
    assert_each_config_once(trials, 2)
    assert all(0.5 < t.user_attrs["test/watch/auroc"] <= 1.0 for t in trials)
    assert run_cli(["report", "--data", "movielens-100k", "--storage", url, "--out", str(tmp_path / "rep")]) == 0
    assert "| movielens-100k/comet | comet |" in capsys.readouterr().out


def test_the_objective_is_val_loss_and_a_study_of_the_older_name_is_reported_and_resumed(tmp_path: Path) -> None:
    """Issue 22.9: ``value_val_loss`` in ``trials_dataframe()`` (optuna-dashboard's axis), not
    ``value_validation loss (best epoch)``; a study named so by an older mtmoe still reports and takes the name."""
    from mtmoe.tuning.study import prepare_study

    space = load_space("movielens-100k", "topk")
    configurations = plan_configurations(space, 2, 0)
    url, name = f"sqlite:///{tmp_path / 'optuna.db'}", "movielens-100k/topk"
    prepare_study(url, name, space, 0, configurations)
    study = optuna.load_study(study_name=name, storage=storage_for(url))
    assert study.metric_names == ["val_loss"]
    study.set_metric_names(["validation loss (best epoch)"])  # as an older mtmoe named it
    study.tell(study.ask(), 0.5)  # configuration 0, complete
    assert trials_module.collect(url, "movielens-100k")[1].objective.tolist() == [0.5]
    prepare_study(url, name, space, 0, configurations)  # what a rerun of tune does first
    study = optuna.load_study(study_name=name, storage=storage_for(url))
    assert study.metric_names == ["val_loss"]
    assert study.trials_dataframe()["value_val_loss"].dropna().tolist() == [0.5]
