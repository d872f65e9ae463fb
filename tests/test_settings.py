"""The settings object (issue 34, item 2): each ``--model.*`` setting is one field of
:class:`mtmoe.pack.settings.ModelSettings`, whose name, type, default and help the command line reads, and every
route to a run (``fit``, :func:`mtmoe.run.build_run`, the tune worker, the Python API) trains with every setting given.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import MISSING, fields
from pathlib import Path

import torch
from jsonargparse import Namespace

from conftest import run_cli
from mtmoe.api import MODEL_SETTINGS
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.mmoe import NetSettings, build_mmoe
from mtmoe.pack.settings import EngineSettings, ModelSettings, OptimSettings, build_trial
from mtmoe.run_settings import model_settings

FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--data.batch_size=64"]
SETTINGS = {setting.name: setting for setting in fields(ModelSettings)}


def fit_args(root: Path, *extra: str) -> list[str]:
    return ["--gate", "topk", "--data", "movielens-100k", f"--data.root={root}", *FAST, *extra]


def test_each_setting_is_one_field_with_help_and_model_settings_is_its_groups() -> None:
    """A name in two groups would be one field silently (dataclass inheritance): the groups are disjoint and make
    up ModelSettings; every field has its help; MultiTaskMoE takes none of them one by one."""
    groups = [{setting.name for setting in fields(group)} for group in (NetSettings, OptimSettings, EngineSettings)]
    assert sum(map(len, groups)) == len(set().union(*groups)) == len(SETTINGS)
    assert all(setting.metadata["help"].strip() for setting in SETTINGS.values())
    assert not set(inspect.signature(MultiTaskMoE).parameters) & set(SETTINGS)
    assert set(MODEL_SETTINGS) == set(SETTINGS) - {"gate"}


def test_build_mmoe_defaults_are_the_settings_defaults() -> None:
    """The architecture builder keeps keyword arguments for its callers: their defaults must be the fields'."""
    for name, parameter in inspect.signature(build_mmoe).parameters.items():
        if name in SETTINGS and name != "gate":
            assert parameter.default == SETTINGS[name].default, name


def test_help_and_defaults_of_the_command_line_are_the_fields(tiny_root: Path) -> None:
    """``fit``'s ``--model.*`` options are the fields, no more, no fewer, each with the field's help and default."""
    from mtmoe.run import build_run

    parser = build_run(fit_args(tiny_root)).cli.parser
    options = {option.removeprefix("--model."): action for option, action in parser._option_string_actions.items()
               if option.startswith("--model.") and "." not in option.removeprefix("--model.")
               and not option.endswith(".help")}
    assert set(options) == set(SETTINGS)
    defaults = parser.get_defaults().model
    for name, setting in SETTINGS.items():
        assert options[name].help == setting.metadata["help"], name
        assert setting.default is not MISSING and defaults[name] == setting.default, name


def test_model_settings_of_a_configuration_build_the_net_fit_builds(tiny_root: Path) -> None:
    """The tune worker's route (a parsed configuration -> ModelSettings -> build_trial) gives the net that ``fit``'s
    route (the CLI instantiating ModelSettings) gives, under the same seed."""
    from mtmoe.run import build_run

    run = build_run(fit_args(tiny_root, "--model.n_experts=4", "--model.gate.k=2", "--model.lr=3e-3",
                             "--seed_everything=5"))
    torch.manual_seed(5)
    trial = build_trial(run.datamodule.info, None, model_settings(run.config.model))
    assert trial.lr == run.model.trial.lr == 3e-3 and trial.task_weights == run.model.trial.task_weights
    built, fitted = trial.net.state_dict(), run.model.net.state_dict()
    assert built.keys() == fitted.keys() and all(torch.equal(built[k], fitted[k]) for k in built)
    partial_config = Namespace(gate=run.config.model.gate, lr=1e-3)  # a setting left out keeps its default
    assert model_settings(partial_config).adam_eps == SETTINGS["adam_eps"].default


def test_build_run_trains_with_early_stopping_as_fit_does(tiny_root: Path) -> None:
    """``build_run(args).trainer.fit(...)`` honours ``--early_stopping.*`` (it trained with patience 25 before):
    with patience 1 and a min_delta no loss beats, both routes stop after 2 of 5 epochs, at the same results."""
    from mtmoe.run import build_run

    args = fit_args(tiny_root, "--trainer.max_epochs=5", "--early_stopping.patience=1",
                    "--early_stopping.min_delta=1e9")
    run = build_run([*args, "--trainer.logger.init_args.name=python"])
    assert (run.model.trial.patience, run.model.trial.min_delta) == (1, 1e9)
    run.trainer.fit(run.model, datamodule=run.datamodule)
    assert run_cli(["fit", *args, "--trainer.logger.init_args.name=command"]) == 0
    command = json.loads(next(Path("runs/command").rglob("results.json")).read_text())
    summary = run.model.engine.summary(0)
    assert summary["epochs_run"] == command["epochs_run"] == 2
    assert (summary["best_epoch"], summary["best_val_loss"]) == (command["best_epoch"], command["best_val_loss"])


def test_planned_values_set_as_values_build_the_run_their_flags_build(tiny_root: Path) -> None:
    """The tune worker's structure: ``build_run(args, values)`` (planned values, no argv strings) is the run of the
    same values given as flags: the same configuration and the same initial weights."""
    from mtmoe.run import build_run

    values = {"model.lr": 3e-3, "model.n_experts": 4, "model.gate.k": 1, "data.batch_size": 32,
              "early_stopping.patience": 2}
    flags = [f"--{key}={value}" for key, value in values.items()]
    given, flagged = build_run(fit_args(tiny_root), values), build_run(fit_args(tiny_root, *flags))
    assert given.config == flagged.config and given.datamodule.batch_size == 32 == flagged.datamodule.batch_size
    assert given.model.trial.patience == 2 and given.model.net.gates[0].k == 1
    assert given.model.net.experts.n_experts == 4
    initial = flagged.model.state_dict()
    assert all(torch.equal(value, initial[key]) for key, value in given.model.state_dict().items())


def test_pack_structure_is_read_from_the_fields_per_trial_flags() -> None:
    """A setting's ``per_trial`` flag is what lets trials that differ in it share a pack (``pack_key``): two planned
    configurations differing in one per-trial setting pack together, in any other setting they do not."""
    from mtmoe.mmoe import documented, per_trial_settings, setting
    from mtmoe.tuning.packs import PER_TRIAL_KEYS, pack_key
    from mtmoe.tuning.space import SearchSpace

    per_trial = per_trial_settings(ModelSettings)
    assert {"lr", "adam_eps", "alpha", "perm_epochs", "zeta"} <= per_trial < set(SETTINGS)
    assert {f"model.{name}" for name in per_trial} <= PER_TRIAL_KEYS
    space = SearchSpace(data="movielens-100k", gate="comet+", trials=2, fixed={"model.gate.k": 2}, distributions={})
    for name in set(SETTINGS) - {"gate"}:
        planned = [{f"model.{name}": value} for value in (0.5, 7)]
        assert (pack_key(space, planned[0]) == pack_key(space, planned[1])) == (name in per_trial), name

    @documented
    class Schedule:
        """A per-trial schedule and a shared switch."""

        warmup: int = setting(0, "warm-up epochs.", per_trial=True)
        shared: bool = setting(False, "a structural switch.")

    assert per_trial_settings(Schedule) == {"warmup"}


#: The ``model`` section of a ``config.yaml`` as runs and trials wrote it before ModelSettings (written by
#: ``python -m mtmoe fit --gate comet+ --model.perm_epochs=1`` at the commit before the settings object).
PRE_SETTINGS_MODEL = """model:
  gate:
    class_path: mtmoe.gates.COMETGate
    init_args:
      k: 2
      gamma: 1.0
      entropy_reg: 1.0
      split_bias: true
  lr: 0.0001
  alpha: 0.9
  n_experts: 16
  embedding_dim: 128
  expert_units: 256
  tower_units: 256
  expert_dropout: 0.5
  keras_init: true
  adam_eps: 1.0e-07
  perm_epochs: 1
  zeta: 0.0001
  perm_per_task: false
  perm_eval_rounded: true
  cuda_graphs: true
  fused_adam: true
  matmul_precision: highest
  dense_selection: topk
"""


def test_fit_config_of_an_older_run_or_trial_trains(tiny_root: Path) -> None:
    """``fit --config config.yaml`` of a run or trial folder written before the settings object still trains."""
    Path("old.yaml").write_text(PRE_SETTINGS_MODEL)
    args = ["fit", "--data", "movielens-100k", f"--data.root={tiny_root}", *FAST, "--config=old.yaml",
            "--trainer.max_epochs=2"]
    assert run_cli(args) == 0
    results = json.loads(next(Path("runs").rglob("results.json")).read_text())
    assert results["gate"] == "comet+" and results["epochs_run"] == 2
