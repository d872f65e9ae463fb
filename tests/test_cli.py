"""The command line says what it does (issue 14: 4-8; issue 15: 4, 10): help and listings, start-up without
Lightning, no adverts or noise, the configuration in force, and bad input as one ``error:`` line with exit code 2
and nothing written."""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torchvision.datasets import MNIST, SVHN

from conftest import run_cli, write_u_data
from image_fixtures import write_mnist

from mtmoe.arguments import UNSUPPORTED_TRAINER_SETTINGS
from mtmoe.data import DATASETS
from mtmoe.data.layout import MNIST_SOURCES, SVHN as SVHN_FILES
from mtmoe.errors import UsageError, did_you_mean

FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--data.batch_size=64"]
COMMANDS = ("fit", "validate", "test", "tune", "report", "bootstrap", "gates", "datasets")
CHECKOUT = Path(__file__).resolve().parents[1]


def fit(root: Path, *extra: str, gate: str = "topk") -> list[str]:
    return ["fit", "--gate", gate, "--data", "movielens-100k", f"--data.root={root}", "--trainer.max_epochs=1", *FAST,
            *extra]


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, lines
    return lines[0]


def python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter on this checkout."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(CHECKOUT), **env})


# ----------------------------------------------------------------------------------- 14.4: what the commands are


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []], ids=["--help", "-h", "no-arguments"])
def test_the_top_level_help_lists_every_command_once(argv: list[str], capsys) -> None:
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert "predict" not in out and "subcommand" not in out and "usage: python -m mtmoe COMMAND" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_documents_its_options(command: str, capsys) -> None:
    assert run_cli([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as words: the help is wrapped to the terminal
    assert f"python -m mtmoe {command}" in out or f"python -m mtmoe [options] {command}" in out
    if command in ("fit", "validate", "test"):
        assert "--gate NAME" in out and "--data NAME" in out and "--ckpt_path" in out and "--trainer.max_epochs" in out


def test_an_unknown_command_names_the_commands(capsys) -> None:
    assert run_cli(["predict"]) == 2
    line = one_error_line(capsys)
    assert "unknown command 'predict'" in line and ", ".join(COMMANDS) in line


# ------------------------------------------------------------------------------------------- 14.7: start-up


@pytest.mark.parametrize("command, absent", [("--help", ("torch", "lightning", "optuna")),
                                             ("datasets", ("torch", "lightning", "optuna")),
                                             ("gates", ("lightning", "pandas", "torchvision"))])
def test_help_and_listings_import_no_lightning(command: str, absent: tuple[str, ...], tmp_path: Path) -> None:
    """What made ``gates`` and ``datasets`` take 6.5-10 s: importing Lightning for commands that train nothing."""
    proc = python(f"import sys\nfrom mtmoe.cli import main\nmain([{command!r}])\n"
                  f"print('imported:', [m for m in {absent!r} if m in sys.modules])", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "imported: []"


# ------------------------------------------------------------------------------------------------ 14.6: noise


@pytest.mark.integration  # a process of its own, importing torch and Lightning: CI, not the inner loop
def test_a_fit_prints_its_progress_results_and_no_adverts(tiny_root: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mtmoe", *fit(tiny_root, "--trainer.limit_train_batches=3")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    assert proc.returncode == 0, proc.stderr
    assert "topk on movielens-100k: val and test of epoch 0's weights" in proc.stdout
    for noise in ("Tip", "litlogger", "LeafSpec", "log_every_n_steps", "Warning"):
        assert noise not in proc.stderr, noise
    assert "GPU available" not in proc.stderr and "Seed set" not in proc.stderr  # MTMOE_VERBOSE=1 shows them


@pytest.mark.integration  # processes of their own, writing to a pipe whose reader has left
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["gates"], ["datasets"]])
def test_output_to_a_reader_that_left_ends_quietly(tmp_path: Path, argv: list[str]) -> None:
    """``python -m mtmoe datasets | head -1``: before, a ``BrokenPipeError`` traceback once ``head`` had gone; now
    nothing on stderr and exit code 141, as a shell tool killed by SIGPIPE."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "mtmoe", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


# ---------------------------------------------------------------------------------------- 14.8: small truths


def test_gates_shows_what_each_search_space_tunes(capsys) -> None:
    assert run_cli(["gates"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["topk"].split()[3:] == ["lr"]  # every space fixes Top-k's k at 2: the old listing said "k"
    assert rows["topk+"].endswith("lr, perm_epochs")
    assert rows["comet"].endswith("lr, gate.gamma, gate.entropy_reg")
    assert "competesmoe+" not in rows and "softmax" in rows


def test_gates_says_whose_search_space_it_lists(capsys) -> None:
    assert run_cli(["gates", "--data", "movielens"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert "searched by tune on movielens (mtmoe/tuning/spaces/movielens.yaml over the gate's defaults; model.* settings)" in header
    assert not any("(" in row.split("  ")[-1] for row in rows)  # one dataset: no per-dataset groups
    assert run_cli(["gates"]) == 0
    assert "searched by tune on every dataset unless named" in capsys.readouterr().out.splitlines()[0]


def test_print_config_shows_the_values_in_force(tiny_root: Path, capsys) -> None:
    assert run_cli(fit(tiny_root, "--print_config")) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    model = config["model"]
    assert model["alpha"] == 0.9 and model["n_experts"] == 16 and model["gate"]["init_args"]["k"] == 2
    assert (model["embedding_dim"], model["expert_units"], model["expert_dropout"]) == (128, 256, 0.5)
    assert not Path("runs").exists()


def test_print_config_shows_the_data_root_in_force(tiny_root: Path, monkeypatch, capsys) -> None:
    """Before: ``data.root: null`` with $MTMOE_DATA set. The run's config.yaml keeps it unset (it follows
    $MTMOE_DATA where it runs again)."""
    monkeypatch.setenv("MTMOE_DATA", str(tiny_root))
    argv = [arg for arg in fit(tiny_root) if not arg.startswith("--data.root")]
    assert run_cli([*argv, "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]["root"] == str(tiny_root)
    monkeypatch.delenv("MTMOE_DATA")
    monkeypatch.setenv("HOME", str(tiny_root.parent))
    assert run_cli([*argv, "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]["root"] == str(
        tiny_root.parent / ".cache" / "mtmoe" / "data")
    assert run_cli([*fit(tiny_root), "--print_config"]) == 0  # --data.root as given
    assert yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]["root"] == str(tiny_root)


def test_options_take_either_spelling(tiny_root: Path, capsys) -> None:
    """fit's keys are Python names (--trainer.max_epochs), tune's/report's/bootstrap's own options hyphenated
    (--study-name): each command takes the other spelling too."""
    from mtmoe.tuning.bootstrap_report import parse_bootstrap_args
    from mtmoe.tuning.study import parse_tune_args

    assert run_cli([*fit(tiny_root), "--trainer.max-epochs=3", "--early-stopping.patience", "4", "--print_config"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["max_epochs"] == 3 and config["early_stopping"]["patience"] == 4
    args, overrides = parse_tune_args(["--gate", "topk", "--data", "movielens", "--study_name", "s", "--log_dir=d",
                                       "--trainer.max_epochs=2"])
    assert (args.study_name, args.log_dir, overrides) == ("s", "d", ["--trainer.max_epochs=2"])
    assert parse_bootstrap_args(["--data", "movielens", "--max_budget", "7"])[0].max_budget == 7
    with pytest.raises(UsageError, match="did you mean --max-budget"):
        parse_bootstrap_args(["--data", "movielens", "--max_budgets", "7"])


def test_perm_epochs_on_a_gate_without_plus_names_the_plus_gate(tiny_root: Path, capsys) -> None:
    assert run_cli(fit(tiny_root, "--model.perm_epochs=2")) == 2
    assert "pass --gate topk+" in one_error_line(capsys)
    assert not Path("runs").exists()


# ------------------------------------------------------------- 14.5, 15.4, 15.10: bad input, one line, exit 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--trainer.accelerator=tpu"], "the trainer settings cannot run here: "),
        (["--trainer.devices=0"], "the trainer settings cannot run here: "),
        (["--trainer.strategy=nonsense"], "invalid strategy name"),
        (["--trainer.max_epochs=0"], "--trainer.max_epochs must be >= 1 (or -1: until early stopping), got 0"),
        (["--trainer.limit_train_batches=0"], "--trainer.limit_train_batches 0 leaves no train batch"),
        (["--early_stopping.patience=-1"], "--early_stopping.patience must be >= 0, got -1"),
        (["--data.batch_size=0"], "error: --data.batch_size 0 is not allowed: batch_size must be >= 1; pass another "
                                  "--data.batch_size"),
        (["--data.eval_batch_size=-5"], "error: --data.eval_batch_size -5 is not allowed: eval_batch_size must be >= 1"),
        # before: tracebacks (dropout, a negative embedding, the seed) or a run of a net without units (0 units)
        (["--model.expert_dropout=1.5"], "--model.expert_dropout 1.5 is not allowed: expert_dropout must be in [0, 1)"),
        (["--model.expert_units=0"], "--model.expert_units 0 is not allowed: expert_units must be >= 1"),
        (["--model.tower_units=0"], "--model.tower_units 0 is not allowed: tower_units must be >= 1"),
        (["--model.embedding_dim=-4"], "--model.embedding_dim -4 is not allowed: embedding_dim must be >= 1"),
        (["--model.adam_eps=-1"], "--model.adam_eps -1.0 is not allowed: adam_eps must be >= 0"),
        (["--early_stopping.min_delta=-1"], "--early_stopping.min_delta must be >= 0 (the least improvement that "
                                            "counts), got -1.0"),
        (["--seed_everything=-5"], "--seed_everything must be between 0 and 4294967295 (or true: a random seed), "
                                   "got -5"),
    ],
)
def test_bad_settings_are_one_error_line_and_leave_nothing(tiny_root: Path, extra: list[str], message: str,
                                                           capsys) -> None:
    assert run_cli(fit(tiny_root, *extra)) == 2
    assert message in one_error_line(capsys)
    assert not Path("runs").exists()


@pytest.mark.parametrize("command", ["fit", "tune"])
@pytest.mark.parametrize("name, content, message", [
    ("missing.yaml", None, "--config missing.yaml is no file: pass a YAML file of settings"),
    (".", None, "--config . is a folder: pass a YAML file of settings"),
    ("bad.yaml", "trainer: [1, 2\n",
     "--config bad.yaml is not valid YAML (expected ',' or ']', but got '<stream end>' at line 2, column 1)"),
    ("list.yaml", "- a\n", "--config list.yaml holds a YAML list, not settings: a mapping of trainer:, model:, "),
    ("empty.yaml", "", "--config empty.yaml holds nothing, not settings"),
])
def test_a_config_file_that_is_no_settings_is_one_line_naming_it(tiny_root: Path, capsys, command: str, name: str,
                                                                  content: str | None, message: str) -> None:
    """Before: 'Parser key "config": File does not exist', 'Problems parsing config: while parsing a flow sequence
    in "<unicode string>" ...', 'Unexpected config: - a' and 'Unexpected config:', naming neither the file (nor
    what is wrong with it, for a folder) nor what to do. Now one line each, for ``fit`` and ``tune`` alike."""
    if content is not None:
        Path(name).write_text(content)
    argv = fit(tiny_root, f"--config={name}")
    if command == "tune":
        argv = ["tune", *argv[1:], "--trials=1", "--storage=sqlite:///s.db"]
    assert run_cli(argv) == 2
    assert message in one_error_line(capsys)
    assert not Path("runs").exists() and not Path("s.db").exists() and not Path("studies").exists()


@pytest.mark.parametrize("command", ["fit", "test"])
def test_a_checkpoint_path_that_is_a_folder_says_so(tiny_root: Path, capsys, command: str) -> None:
    """Before: "no checkpoint file FOLDER", as if it were missing. Now it says it is a folder and what to pass."""
    Path("checkpoints").mkdir()
    assert run_cli([command, *fit(tiny_root)[1:], "--ckpt_path=checkpoints"]) == 2
    assert "--ckpt_path checkpoints is a folder: pass a checkpoint file in it (a fit's runs/lightning_logs/" \
        "version_N/checkpoints/best.ckpt or last.ckpt)" in one_error_line(capsys)
    assert not Path("runs").exists()


def test_a_data_root_that_is_a_file_says_so(tmp_path: Path, monkeypatch, capsys) -> None:
    """Before: "cannot write to data root FILE (File exists)", mkdir's reason. Now it says the root is a file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MTMOE_CACHE", str(tmp_path / "cache"))
    Path("a-file").write_text("not a folder")
    assert run_cli(["fit", "--gate", "topk", "--data", "movielens-100k", "--data.root=a-file", *FAST]) == 2
    assert "cannot write to data root a-file (a file, not a folder): pass a writable --data.root" in \
        one_error_line(capsys)
    assert Path("a-file").read_text() == "not a folder" and not Path("runs").exists()


@pytest.mark.parametrize("value", ["-1e-3", "-2.5E-4"])
def test_a_negative_number_in_exponent_notation_is_a_value(tiny_root: Path, capsys, value: str) -> None:
    """Before: ``--model.lr -1e-3`` was "argument --model.lr: expected one argument" (argparse takes ``-1e-3`` for
    an option, unlike ``-1``). Now it is the flag's value, refused for what it is."""
    assert run_cli([*fit(tiny_root), "--model.lr", value]) == 2
    assert f"--model.lr {float(value)} is not allowed: lr must be > 0" in one_error_line(capsys)
    assert not Path("runs").exists()


#: A gate setting out of its range (16 experts on MovieLens-100K): gate, flag, value, what the setting allows.
GATE_SETTINGS_OUT_OF_RANGE = [
    *((gate, "k", "17", "must satisfy 1 <= k <= n_experts = 16") for gate in
      ("topk", "topk-sigmoid", "topk-lossfree", "dselect", "comet", "moesart", "remoe", "competesmoe",
       "competesmoe-v2")),
    ("comet", "k", "0", "must satisfy 1 <= k <= n_experts = 16"),
    ("expertchoice", "k", "16.5", "must satisfy 0 < k <= n_experts = 16"),
    ("usmoe", "k", "0", "must satisfy 0 < k <= n_experts = 16"),
    ("usmoe", "alpha", "1.5", "must be in [0, 1]"),
    ("dselect", "gamma", "0", "must be > 0"),
    ("dselect", "entropy_reg", "-1", "must be >= 0"),
    ("dselect", "zeta", "-1", "must be >= 0"),
    ("comet", "entropy_reg", "-1", "must be >= 0"),
    ("moesart", "biasness", "big", "must be one of small-random, zero"),
    ("moesart", "trimmed_lasso_reg", "-1", "must be >= 0"),
    ("remoe", "l1_init", "0", "must be > 0"),
    ("remoe", "l1_multiplier", "1", "must be > 1"),
    ("sparsemixer", "top_k", "3", "must be 1 (the paper) or 2 (an extension)"),
    ("sparsemixer", "midpoint_prob", "2", "must be in [0, 1]"),
    ("sparsemixer", "jitter", "-1", "must be >= 0"),
    ("competesmoe", "competition_prob", "2", "must be in [0, 1]"),
    ("competesmoe", "router_loss_coef", "-1", "must be >= 0"),
    ("competesmoe-v2", "warmup", "2", "must be in [0, 1]"),
    ("topany", "aux_coef", "-1", "must be >= 0"),
    ("topk-lossfree", "bias_rate", "-1", "must be >= 0"),
]


@pytest.mark.parametrize("gate, name, value, allowed", GATE_SETTINGS_OUT_OF_RANGE)
def test_a_gate_setting_out_of_range_names_its_flag_and_what_it_allows(tiny_root: Path, capsys, gate: str, name: str,
                                                                         value: str, allowed: str) -> None:
    """Before: ``fit --gate topk --model.gate.k 20`` said "k must satisfy 1 <= k <= n_experts, got k=20 with
    n_experts=16", naming neither the flag to change nor the bound in force. Now every gate's range check names
    ``--model.gate.NAME``, what it allows (with the number of experts in force), and the flag that bounds it."""
    assert run_cli(fit(tiny_root, f"--model.gate.{name}={value}", gate=gate)) == 2
    line = one_error_line(capsys)
    assert f"--model.gate.{name} " in line and f"is not allowed: {name} {allowed}; pass another --model.gate.{name}" \
        in line, line
    assert line.endswith(", or change --model.n_experts") == (name == "k")
    assert not Path("runs").exists()


def test_every_gate_with_k_is_checked() -> None:
    """The table above covers every registered gate that takes ``k``: a new one is added there."""
    from mtmoe.gates import gate_class, list_gates
    from mtmoe.run_settings import init_arguments

    with_k = {name for name in list_gates() if "k" in init_arguments(gate_class(name))}
    assert with_k == {gate for gate, name, _, _ in GATE_SETTINGS_OUT_OF_RANGE if name == "k"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_readmes_gpu_command_on_a_machine_without_one(tiny_root: Path, capsys) -> None:
    """docs/training.md's ``fit --gate comet+ --data multimnist --trainer.accelerator gpu`` (here on the tiny MovieLens)."""
    assert run_cli(fit(tiny_root, "--trainer.accelerator=gpu", gate="comet+")) == 2
    assert "the trainer settings cannot run here: No supported gpu backend found" in one_error_line(capsys)
    assert not Path("runs").exists()


def test_evaluating_needs_a_checkpoint(tiny_root: Path, capsys) -> None:
    for command in ("validate", "test"):
        assert run_cli([command, *fit(tiny_root)[1:]]) == 2
        assert f"{command} evaluates a checkpoint: pass --ckpt_path" in one_error_line(capsys)
    assert not Path("runs").exists()


def test_an_output_folder_that_cannot_be_made_is_one_error_line(tiny_root: Path, capsys) -> None:
    blocked = Path("a-file")
    blocked.write_text("not a folder")
    assert run_cli(fit(tiny_root, f"--trainer.logger.init_args.save_dir={blocked / 'runs'}")) == 2
    line = one_error_line(capsys)
    assert f"cannot create the run's log folder in {blocked / 'runs' / 'lightning_logs'} (Not a directory)" in line
    assert "--trainer.logger.init_args.save_dir" in line


def test_a_diverged_fit_says_so_and_exits_1(tiny_root: Path, capsys) -> None:
    assert run_cli(fit(tiny_root, "--model.adam_eps=0", "--trainer.max_epochs=2")) == 1
    line = one_error_line(capsys)
    results = json.loads(next(Path("runs").rglob("results.json")).read_text())
    assert line.startswith(f"error: the fit diverged ({results['diverged']})") and "loss nan at epoch 0" in line
    assert "best_epoch" not in results and not list(Path("runs").rglob("best.ckpt"))


# ----------------------------------------------------------------------- 22.4, 22.5: bad input, one short line


@pytest.mark.parametrize("extra, message", [
    (["--model.gate.k=2.5"], "error: --model.gate.k takes int or null, got 2.5"),
    (["--seed_everything=abc"], "error: --seed_everything takes bool or int, got abc"),
    (["--model.keras_init=maybe"], "error: --model.keras_init takes bool, got maybe"),
    (["--trainer.max_epoch=2"], "did you mean --trainer.max_epochs? (options are not abbreviated)"),
    (["--model.gate.kk=2"], "error: --model.gate.kk: TopKGate takes no argument 'kk'; did you mean --model.gate.k?"),
    (["--data.batchsize=8"], "error: --data.batchsize: MovieLens100KDataModule takes no argument 'batchsize'; did "
                             "you mean --data.batch_size?"),
    (["--data.zzz=8"], "error: --data.zzz: MovieLens100KDataModule takes no argument 'zzz'; --data.help "
                       "mtmoe.data.movielens.MovieLens100KDataModule lists its arguments"),
])
def test_a_bad_value_or_option_names_the_key_in_one_line(tiny_root: Path, extra: list[str], message: str,
                                                        capsys) -> None:
    assert run_cli(fit(tiny_root, *extra)) == 2
    line = one_error_line(capsys)
    assert message in line and len(line) < 160, line
    assert not Path("runs").exists()


@pytest.mark.parametrize("early, chooser", [(["--model.gate.k=2"], "--gate"),
                                            (["--data.negative_seed", "3"], "--data")])
def test_an_argument_of_a_class_given_before_the_class_says_so(tiny_root: Path, early: list[str], chooser: str,
                                                               capsys) -> None:
    """Before: ``--model.gate.k=2 --gate topk`` was "Gate takes no argument 'k'" (jsonargparse gives it to the base
    class, as the ``--data`` arguments to InMemoryDataModule): an argument the chosen class takes, refused by the
    name of another. Now the line says to give the option that chooses the class first."""
    assert run_cli(["fit", *early, *fit(tiny_root)[1:]]) == 2
    flag = early[0].partition("=")[0]
    assert one_error_line(capsys) == (f"error: {flag} is given before {chooser}, which chooses the class it is an "
                                      f"argument of: give {chooser} first, then its arguments")
    assert not Path("runs").exists()


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_missing_dataset_names_the_flag(command: str, capsys) -> None:
    """Before: "the following arguments are required: fit.data" (jsonargparse's key, no flag of that name)."""
    assert run_cli([command, "--gate", "topk"]) == 2
    assert one_error_line(capsys) == (f"error: {command}: the following arguments are required: --data (NAME: "
                                      "python -m mtmoe datasets lists them)")


def test_did_you_mean_never_suggests_the_group_of_a_dotted_option() -> None:
    """Before: ``--trainer.foo`` was answered "did you mean --trainer?" (the option of a trainer config file)."""
    options = ["--trainer", "--trainer.max_epochs", "--model", "--model.lr"]
    assert "--trainer?" not in did_you_mean("--trainer.foo", options)
    assert did_you_mean("--model.foo", ["--model", "--trainer.max_epochs"]) == ""
    assert did_you_mean("--model.lrr=3", options) == ": did you mean --model.lr?"
    assert did_you_mean("--trainer.max_epoch", options) == (": did you mean --trainer.max_epochs? (options are not "
                                                            "abbreviated)")


def test_an_unknown_key_of_a_config_file_names_the_file_and_the_closest_key(tiny_root: Path, capsys) -> None:
    Path("run.yaml").write_text("trainer:\n  max_epochz: 3\n")
    assert run_cli(fit(tiny_root, "--config=run.yaml")) == 2
    assert "no setting 'trainer.max_epochz' in run.yaml: did you mean 'trainer.max_epochs'?" in one_error_line(capsys)


def test_the_version(capsys) -> None:
    from importlib.metadata import version

    assert run_cli(["--version"]) == 0
    assert capsys.readouterr().out == f"mtmoe {version('mtmoe')}\n"


@pytest.mark.integration
def test_lightnings_seed_and_hardware_lines_only_when_verbose(tiny_root: Path, tmp_path: Path) -> None:
    """A window longer than the run: one line with the fix, no ``Seed set``/``GPU available`` before it unless
    MTMOE_VERBOSE=1."""
    args = [sys.executable, "-m", "mtmoe", *fit(tiny_root, "--trainer.max_epochs=2", gate="comet+")]
    for verbose in ("0", "1"):
        proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(CHECKOUT), "MTMOE_VERBOSE": verbose})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        lines = proc.stderr.splitlines()
        assert lines[-1] == ("error: perm_epochs=5 is longer than the run (--trainer.max_epochs=2): the permutation "
                             "would never be rounded and frozen; pass --model.perm_epochs 2 or less, or "
                             "--trainer.max_epochs 5 or more")
        if verbose == "0":
            assert len(lines) == 1, lines
        else:
            assert any(line.startswith("Seed set to 0") for line in lines)
            assert any(line.startswith("GPU available: ") for line in lines)


def test_test_takes_the_dataset_from_the_checkpoint(tiny_root: Path, capsys) -> None:
    assert run_cli(fit(tiny_root, "--trainer.limit_train_batches=2")) == 0
    best = next(Path("runs").rglob("best.ckpt"))
    capsys.readouterr()
    assert run_cli(["test", f"--ckpt_path={best}", f"--data.root={tiny_root}", *FAST[:2]]) == 0
    assert f"topk on movielens-100k: test of the weights of {best}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ 22.8: help that answers at once


ANSWERED_WITHOUT_TORCH = {  # argv -> exit code, the error line's text (None: no error)
    ("--help",): (0, None),
    ("--version",): (0, None),
    ("report", "--help"): (0, None),
    ("bootstrap", "--help"): (0, None),
    ("tune", "--help"): (0, None),
    ("gates", "--help"): (0, None),
    ("datasets", "--help"): (0, None),
    ("datasets",): (0, None),
    ("gates", "--data", "nope"): (2, "error: gates: argument --data: invalid choice: 'nope'"),
    ("predict",): (2, "unknown command 'predict'"),
    ("report", "--data", "nope"): (2, "no study storage at "),
    ("bootstrap", "--data", "nope"): (2, "no study storage at "),
    ("report", "--data", "movielens", "--storag", "x"): (2, "did you mean --storage? (options are not abbreviated)"),
    ("bootstrap", "--data", "movielens", "--max", "3"): (2, "did you mean --max-budget?"),
    ("tune", "--gate", "nope", "--data", "movielens"): (2, "unknown gate 'nope'; valid gates: comet, "),
    ("tune", "--gate", "topk", "--data", "nope"): (2, "unknown dataset 'nope'"),
    ("tune", "--gate", "topk", "--data", "movielens", "--tri", "3"): (2, "did you mean --trials?"),
    ("tune", "--gate", "topk", "--data", "movielens", "--trials", "x"): (2, "tune: argument --trials: invalid int"),
    ("tune", "--gate", "topk", "--data", "movielens", "--pack", "0"): (2, "--pack must be a positive number"),
    ("tune", "--gate", "topk", "--data", "movielens", "--workers", "0"): (2, "--workers must be >= 1, got 0"),
    ("fit", "--gate", "comt+"): (2, "unknown gate 'comt+'; valid gates: comet, "),
    ("fit", "--data", "movielens", "--gate=comt+"): (2, "names a gate class of your own); did you mean comet+?"),
    ("fit", "--gate", "topk", "--data", "movielen"): (2, "unknown dataset 'movielen'; valid datasets: books, "),
    ("test", "--data=movielen", "--ckpt_path", "x.ckpt"): (2, "did you mean movielens?"),
    ("validate", "--gate"): (2, "--gate needs a value"),
    ("fit", "--gate", "topk", "--model.perm_epochs", "3"): (2, "--model.perm_epochs adds local search to topk"),
    ("fit", "--gate", "topk", "--trainer.max_steps", "5"): (2, "--trainer.max_steps 5 is not supported by mtmoe's "
                                                              "training engine: a trial's budget is"),
    ("fit", "--gate", "topk", "--trainer.gradient_clip_val=1"): (2, "--trainer.gradient_clip_val 1 is not supported"),
}


@pytest.mark.integration
def test_help_and_errors_that_need_no_model_import_no_torch(tmp_path: Path) -> None:
    """Every help but fit's and every error that needs no model answers before torch is imported (what made
    `report --help` take seconds): one interpreter runs them all, then looks for torch."""
    code = f"""
import contextlib, io, json, sys
from mtmoe.cli import main
answers = []
for argv in {[list(argv) for argv in ANSWERED_WITHOUT_TORCH]!r}:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as exit_:
            code = exit_.code or 0
    answers.append([code, err.getvalue()])
print(json.dumps({{"answers": answers, "imported": [m for m in ("torch", "lightning") if m in sys.modules]}}))
"""
    proc = python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    for (argv, (code, text)), (got, err) in zip(ANSWERED_WITHOUT_TORCH.items(), result["answers"]):
        assert got == code, (argv, err)
        if text is None:
            assert err == "", (argv, err)
        else:
            assert err.count("\n") == 1 and err.startswith("error: ") and text in err, (argv, err)
    assert result["imported"] == []


def datasets_rows(capsys: pytest.CaptureFixture) -> tuple[str, dict[str, list[str]]]:
    """``datasets``' header line and its rows, dataset -> [dataset, DataModule, files go in, files]."""
    header, columns, *lines = capsys.readouterr().out.splitlines()
    assert re.split(r"\s{2,}", columns) == ["dataset", "DataModule", "files go in", "files"]
    return header, {line.split()[0]: re.split(r"\s{2,}", line, maxsplit=3) for line in lines}


def test_datasets_says_whose_files_are_under_the_data_root_and_where_they_go(tiny_root: Path, tmp_path: Path,
                                                                           monkeypatch, capsys) -> None:
    write_mnist(tiny_root, gz=True)  # the .gz files alone: present, gunzipped on first use
    monkeypatch.setenv("MTMOE_DATA", str(tiny_root))
    assert run_cli(["datasets"]) == 0
    header, rows = datasets_rows(capsys)
    assert header == f"data root: {tiny_root} (MTMOE_DATA; --data.root PATH looks elsewhere)"
    assert sorted(rows) == sorted(DATASETS)
    assert rows["movielens-100k"][1:] == [DATASETS["movielens-100k"], str(tiny_root / "ml-100k"), "present"]
    assert rows["multimnist"][3] == "present"
    assert rows["movielens"][2:] == [str(tiny_root / "ml-1m"), "missing ml-1m/ratings.dat (downloaded on first use)"]
    assert rows["digits"][2:] == [f"{tiny_root / 'MNIST' / 'raw'}, {tiny_root / 'SVHN'}",
                                  "missing SVHN/train_32x32.mat and 2 more (downloaded on first use)"]
    assert rows["books"][3].startswith("missing book-crossing/BX-CSV-Dump.zip (place them there by hand: the "
                                       "official host is reported offline")
    assert run_cli(["datasets", f"--data.root={tmp_path / 'elsewhere'}"]) == 0  # --data.root wins over MTMOE_DATA
    header, rows = datasets_rows(capsys)
    assert header == f"data root: {tmp_path / 'elsewhere'} (--data.root)"  # before: "; --data.root PATH looks ..."
    assert rows["movielens-100k"][3] == "missing ml-100k/u.data (downloaded on first use)"


def test_datasets_lists_the_files_each_datamodule_reads(tmp_path: Path, capsys) -> None:
    """One table (mtmoe.data.layout): offline on an empty root, every DataModule asks for the file `datasets` names
    first."""
    root = tmp_path / "empty"
    assert run_cli(["datasets", f"--data.root={root}"]) == 0
    _, rows = datasets_rows(capsys)
    for name, path in DATASETS.items():
        module, cls = path.rsplit(".", 1)
        data = getattr(importlib.import_module(module), cls)(root=str(root), cache_dir=str(tmp_path), download=False)
        with pytest.raises(UsageError) as error:
            data.load_splits()
        first = rows[name][3].split()[1]
        assert f"missing {root / first}:" in str(error.value), (name, rows[name])
    assert [Path(name).stem for name, _ in MNIST.resources] == list(MNIST_SOURCES["MNIST"].files)  # torchvision's
    assert [SVHN.split_list[part][1] for part in ("train", "test", "extra")] == list(SVHN_FILES.files)


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
def test_run_help_lists_what_a_run_honours_shortcuts_first(command: str, capsys) -> None:
    assert run_cli([command, "--help"]) == 0
    out = capsys.readouterr().out
    groups = re.findall(r"^(\S.*):\n  -", out, re.MULTILINE)  # a group's title, then its first option
    assert groups[0] == "shortcuts" and groups[-1] == "trainer: Lightning's settings that a run honours"
    for key in UNSUPPORTED_TRAINER_SETTINGS:  # refused by the engine: not offered
        assert f"--trainer.{key}" not in out, key
    assert "--model.info" not in out and "registry:model-name" not in out and "--trainer.max_epochs" in out
    assert out.startswith(f"usage: python -m mtmoe {command} ") and len(out.splitlines()[0]) < 100
    # jsonargparse lists the Callback subclasses imported in this process: the tests' own do not count
    own_callbacks = {path.stem for path in Path(__file__).parent.glob("*.py")}
    assert len([line for line in out.splitlines() if line.strip().split(".")[0] not in own_callbacks]) < 450


def test_fit_help_lists_the_shortcuts_with_their_choices(capsys) -> None:
    assert run_cli(["fit", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "shortcuts: --gate NAME a registered gate, one of comet[+], competesmoe, competesmoe-v2," in out
    assert "NAME: a registered dataset, one of books, celeba, digits, jester, movielens, movielens-100k," in out
    for name in ("n_experts", "embedding_dim", "expert_units", "tower_units", "expert_dropout"):
        description = out.split(f"--model.{name} {name.upper()} ", 1)[1]
        assert not description.startswith("(type:"), name  # a description before the type


#: ``python -m mtmoe ARGV`` with Ctrl-C (a real SIGINT) delivered when MODULE is first imported.
CTRL_C_ON_IMPORT = """
import os, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job starts with it ignored)

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["mtmoe", *ARGV]
runpy.run_module("mtmoe", run_name="__main__")
"""


def ctrl_c_on_import(module: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return python(CTRL_C_ON_IMPORT.replace("MODULE", repr(module)).replace("ARGV", repr(argv)), cwd,
                  MTMOE_CACHE=str(cwd / "cache"))


@pytest.mark.integration
def test_ctrl_c_while_the_command_line_loads_is_one_line(tmp_path: Path) -> None:
    """Before: Ctrl-C in the first fraction of a second of ``python -m mtmoe`` (importing the command line) was a
    KeyboardInterrupt traceback of 20 to 50 lines. Now the one line Ctrl-C gives later, exit code 130."""
    proc = ctrl_c_on_import("mtmoe.cli", ["--help"], tmp_path)
    assert proc.returncode == 130 and proc.stderr == "error: interrupted (Ctrl-C)\n", proc.stderr[-2000:]
    assert proc.stdout == ""


@pytest.mark.integration
def test_ctrl_c_before_tune_opens_the_storage_says_nothing_was_written(tmp_path: Path) -> None:
    """Before: Ctrl-C while ``tune`` checked its settings said "trials in flight are marked failed and run again
    when the same tune command runs again (it resumes the study)", of a study never created. Now it says nothing
    was written, and nothing was."""
    write_u_data(tmp_path / "data")
    proc = ctrl_c_on_import("mtmoe.tuning.packs", ["tune", "--gate", "topk", "--data", "movielens-100k", "--trials",
                                                   "1", f"--data.root={tmp_path / 'data'}"], tmp_path)
    assert proc.returncode == 130 and proc.stderr == ("error: interrupted (Ctrl-C); before the study storage was "
                                                      "opened: nothing was written; run the same command again\n"), \
        proc.stderr[-2000:]
    assert not (tmp_path / "studies").exists()
