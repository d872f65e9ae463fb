"""A gate or a dataset is one file: found without an import list (:mod:`mtmoe.discovery`), searched over its own
defaults where a dataset's space file has no section for it, and usable from outside the package through an entry
point or ``module:Class``.

The packaged spaces plan as before gates declared their own ranges: ``tests/data/planned_spaces.json`` holds, for
every gate and "+" variant registered at ba3db56 on every dataset, the space's fingerprint, its trials, its searched
keys in order and a hash of its first 20 configurations at seed 0 with their config hashes (what a study stores),
recorded with :func:`planned` (through ``load_space(data, gate)``) at ba3db56's code.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from conftest import run_cli

from mtmoe import gate_names
from mtmoe.data import DATASETS
from mtmoe.gates import gate_class, list_gates, parse_gate_name, registry
from mtmoe.tuning.objective import config_hash, plan_configurations
from mtmoe.tuning.space import gate_space, load_space, read_space_file

PACKAGE = Path(__file__).resolve().parents[1] / "mtmoe"
RECORD = Path(__file__).resolve().parent / "data" / "planned_spaces.json"
TINY = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=5", "--trainer.limit_val_batches=2",
        "--trainer.limit_test_batches=2", "--data.batch_size=64", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false"]
optuna.logging.set_verbosity(optuna.logging.WARNING)


def copied_gate() -> str:
    """``mtmoe/gates/softmax.py`` as a new gate: its registered name and its class renamed, nothing else."""
    source = (PACKAGE / "gates" / "softmax.py").read_text()
    assert source.count('@register_gate("softmax")') == 1 and source.count("class SoftmaxGate(") == 1
    return source.replace('@register_gate("softmax")', '@register_gate("softmax-copy")').replace(
        "class SoftmaxGate(", "class SoftmaxCopyGate(")


def planned(document: dict, where: str, gate: str) -> list:
    space = gate_space(document, where, gate)
    plan = plan_configurations(space, 20, 0)
    digest = hashlib.sha256(json.dumps([[p, config_hash(space, p)] for p in plan]).encode()).hexdigest()[:16]
    return [space.fingerprint, space.trials, list(space.distributions), digest]


def test_packaged_spaces_plan_as_before_gates_declared_their_ranges() -> None:
    record = json.loads(RECORD.read_text())
    assert len(record) == 8 * 28  # 8 datasets x (15 gates and 13 "+" variants) at ba3db56
    assert {key.split("/")[0] for key in record} == set(DATASETS)
    documents = {data: read_space_file(data) for data in DATASETS}  # load_space(data, gate), each file read once
    for key, expected in record.items():
        data, gate = key.split("/")
        assert planned(*documents[data], gate) == expected, key


def test_gate_and_dataset_names_are_read_from_the_files() -> None:
    """The names the files register are those of the classes, imported; the listing imports nothing."""
    assert list_gates() == sorted(gate_names.gate_paths())
    for name, path in gate_names.gate_paths().items():
        assert f"{gate_class(name).__module__}:{gate_class(name).__qualname__}" == path
        assert gate_class(name).registry_name == name
    from mtmoe.run_settings import import_class

    assert len(DATASETS) == 8
    for name, path in DATASETS.items():
        assert import_class(path).registry_name == name


def test_a_datasets_static_facts_are_its_info() -> None:
    """Each packaged dataset's task weighting, read from its file (no import), is its DataModule's ``info``, and the
    default alpha ``report`` shows is the one a run without ``--model.alpha`` trains with."""
    from mtmoe.data import task_weighting
    from mtmoe.discovery import registrations
    from mtmoe.losses import task_weights
    from mtmoe.run_settings import import_class
    from mtmoe.tuning.trials import default_alpha

    read = {name: literals["task_weighting"] for name, (_, literals) in
            registrations("mtmoe.data", "register_dataset").items()}
    assert set(read) == set(DATASETS)
    for name, path in DATASETS.items():
        info = import_class(path)(download=False).info
        assert read[name] == task_weighting(name) == info.task_weighting, name
        alpha = f"{task_weights(info, None)[0]:g}" if info.task_weighting == "alpha" else None
        assert default_alpha(name) == alpha, name
    assert {name for name, weighting in read.items() if weighting == "alpha"} == {
        "books", "jester", "movielens", "movielens-100k"}  # the paper's recommenders (comet-protocol.md §5)
    assert task_weighting("no-such-dataset") is None and default_alpha("no-such-dataset") is None


@pytest.mark.integration
def test_listing_the_names_imports_no_torch() -> None:
    code = ("import sys; from mtmoe.gate_names import gate_paths; from mtmoe.data import DATASETS; "
            "assert 'comet' in gate_paths() and 'movielens' in DATASETS; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'optuna')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          cwd=PACKAGE.parent)
    assert proc.stdout.strip() == "[]"


def test_a_gate_without_a_section_is_searched_over_its_defaults(tmp_path: Path) -> None:
    """The file's fixed values and its defaults, then the gate's own ``search_space``, the learning rate and, for
    "+", the local-search window; a "+" variant without a section of its own takes its gate's."""
    path = tmp_path / "space.yaml"
    path.write_text("data: movielens-100k\ntrials: 7\nfixed:\n  data.batch_size: 64\n"
                    "defaults:\n  model.lr: {log_uniform: [1.0e-4, 1.0e-3]}\ngates:\n"
                    "  comet:\n    model.gate.gamma: 5\n    model.lr: {log_uniform: [5.0e-5, 5.0e-4]}\n")
    space = load_space("movielens-100k", "expertchoice+", path)
    assert space.trials == 7 and space.fixed == {"data.batch_size": 64, "model.zeta": 1e-4}
    assert list(space.distributions) == ["model.lr", "model.gate.k", "model.perm_epochs"]
    assert space.distributions["model.gate.k"].choices == (1, 2) and space.distributions["model.lr"].low == 1e-4
    softmax = load_space("movielens-100k", "softmax", path)
    assert list(softmax.distributions) == ["model.lr"] and softmax.distributions["model.lr"].low == 1e-4
    comet_plus = load_space("movielens-100k", "comet+", path)
    assert comet_plus.fixed["model.gate.gamma"] == 5 and comet_plus.distributions["model.lr"].low == 5e-5
    assert list(comet_plus.distributions) == ["model.lr", "model.gate.entropy_reg", "model.perm_epochs"]


@pytest.mark.parametrize("pairs, gates, expected", [
    ("comet:comet+", ["comet", "comet+"], ("comet", "comet+")),
    ("my_gates:Mine+:my_gates:Mine", ["my_gates:Mine", "my_gates:Mine+"], ("my_gates:Mine+", "my_gates:Mine")),
    ("comet:nope", ["comet"], ("comet", "nope")),
])
def test_bootstrap_pairs_split_where_both_sides_are_gates(pairs: str, gates: list[str], expected: tuple) -> None:
    from mtmoe.tuning.bootstrap_report import split_pair

    assert split_pair(pairs, gates) == expected


# ------------------------------------------------------------------------------------ a new gate, one file


def run(code: str, cwd: Path, pythonpath: str, root: Path) -> subprocess.CompletedProcess:
    """``python -c CODE`` in a fresh interpreter with ``PYTHONPATH`` (its entry points found there), tiny data."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "MTMOE_DATA": str(root),
           "MTMOE_CACHE": str(cwd / "cache"), "MTMOE_VERIFY": "false", "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def gates_rows(out: str) -> dict[str, str]:
    """The rows of a ``gates`` listing in ``out``, by gate."""
    return {line.split()[0]: line for line in out.splitlines() if line.split()[1:2] in (["dense"], ["sparse"])}


COPY_RUN = """\
import optuna
from mtmoe.cli import main
main(["gates", "--data", "movielens-100k"])
main(["fit", "--gate", "softmax-copy", "--data", "movielens-100k", *{tiny}])
main(["fit", "--gate", "softmax-copy+", "--data", "movielens-100k", "--model.perm_epochs=1", *{tiny}])
main(["tune", "--gate", "softmax-copy", "--data", "movielens-100k", "--trials", "1", "--storage", "sqlite:///s.db",
      *{tiny}])
(trial,) = optuna.load_study(study_name="movielens-100k/softmax-copy", storage="sqlite:///s.db").get_trials()
print("trial", trial.state.name, list(trial.params))
"""


@pytest.mark.integration
def test_a_gate_file_copied_into_the_package_is_listed_trained_and_tuned(root_and_tmp) -> None:
    """A copy of the package with one new file in ``mtmoe/gates/``: ``gates`` lists it, ``fit`` trains it with and
    without local search, ``tune`` searches its own default space (no section in movielens-100k.yaml)."""
    root, tmp = root_and_tmp
    shutil.copytree(PACKAGE, tmp / "copy" / "mtmoe", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp / "copy" / "mtmoe" / "gates" / "softmax_copy.py").write_text(copied_gate())
    proc = run(COPY_RUN.format(tiny=TINY), tmp, str(tmp / "copy"), root)
    assert proc.returncode == 0, proc.stderr
    rows = gates_rows(proc.stdout)
    assert rows["softmax-copy"].split()[1:] == ["dense", "mtmoe.gates.softmax_copy.SoftmaxCopyGate", "lr"]
    assert rows["softmax-copy+"].endswith("lr, perm_epochs")
    assert "softmax-copy on movielens-100k" in proc.stdout and "softmax-copy+ on movielens-100k" in proc.stdout
    assert "trial COMPLETE ['model.lr']" in proc.stdout


def write_plugin(folder: Path, entry_points: str | None = None) -> Path:
    """``my_gates.py`` (the copied gate) and ``my_data.py`` (a DataModule) in ``folder``, and an installed
    distribution's entry points for them there (a dist-info folder) when ``entry_points`` is given."""
    folder.mkdir()
    (folder / "my_gates.py").write_text(copied_gate())
    (folder / "my_data.py").write_text('"""MovieLens-100K under another name."""\nfrom mtmoe.data.movielens import '
                                       "MovieLens100KDataModule\n\n\nclass MyData(MovieLens100KDataModule):\n"
                                       '    """The same data."""\n')
    if entry_points is not None:
        info = folder / "my_plugin-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(entry_points)
    return folder


def test_a_gate_outside_the_package_by_module_and_class(root_and_tmp, monkeypatch, capsys) -> None:
    """``--gate my_gates:SoftmaxCopyGate+`` trains, and ``tune`` searches the gate's defaults (the registry and
    ``sys.modules`` are restored after the test)."""
    root, tmp = root_and_tmp
    monkeypatch.syspath_prepend(str(write_plugin(tmp / "plugin")))
    monkeypatch.setattr(registry, "_GATES", dict(registry._GATES))  # my_gates registers softmax-copy on import
    monkeypatch.setitem(sys.modules, "my_gates", None)  # recorded as absent: removed again after the test
    del sys.modules["my_gates"]
    cls, plus = parse_gate_name("my_gates:SoftmaxCopyGate+")
    assert cls.__name__ == "SoftmaxCopyGate" and plus
    fit = ["fit", "--gate", "my_gates:SoftmaxCopyGate+", "--data", "movielens-100k", f"--data.root={root}",
           "--model.perm_epochs=1", *TINY]
    assert run_cli(fit) == 0
    assert "softmax-copy+ on movielens-100k" in capsys.readouterr().out
    storage = f"sqlite:///{tmp / 'studies.db'}"
    assert run_cli(["tune", "--gate", "my_gates:SoftmaxCopyGate", "--data", "movielens-100k", "--trials", "1",
                    "--storage", storage, f"--data.root={root}", *TINY]) == 0
    study = optuna.load_study(study_name="movielens-100k/my_gates:SoftmaxCopyGate", storage=storage)
    assert study.user_attrs["gate"] == "my_gates:SoftmaxCopyGate"
    assert [(t.state, list(t.params)) for t in study.get_trials()] == [(optuna.trial.TrialState.COMPLETE, ["model.lr"])]


PLUGIN_RUN = """\
from mtmoe.cli import main
from mtmoe.tuning.space import gate_space, load_space, read_space_file
main(["gates", "--data", "movielens-100k"])
main(["datasets"])
main(["fit", "--gate", "softmax-copy+", "--data", "ml-copy", "--model.perm_epochs=1", *{tiny}])
space = load_space("ml-copy", "softmax-copy")
print("space", space.trials, space.fixed, list(space.distributions))
from mtmoe.tuning.trials import default_alpha
print("default alpha", default_alpha("ml-copy"))
"""


@pytest.mark.integration
def test_a_gate_and_a_dataset_outside_the_package_by_entry_points(root_and_tmp) -> None:
    """An installed distribution's entry points: ``gates`` and ``datasets`` list them, ``fit`` trains the gate's "+"
    on the dataset, and the dataset, with no space file, is searched over the defaults (S1.3's 500 trials)."""
    root, tmp = root_and_tmp
    folder = write_plugin(tmp / "plugin", "[mtmoe.gates]\nsoftmax-copy = my_gates:SoftmaxCopyGate\n\n"
                                          "[mtmoe.datasets]\nml-copy = my_data:MyData\n")
    proc = run(PLUGIN_RUN.format(tiny=TINY), tmp, f"{PACKAGE.parent}:{folder}", root)
    assert proc.returncode == 0, proc.stderr
    rows = gates_rows(proc.stdout)
    assert rows["softmax-copy"].split()[1:] == ["dense", "my_gates.SoftmaxCopyGate", "lr"]
    assert rows["softmax-copy+"].endswith("lr, perm_epochs")
    assert any(line.split()[:2] == ["ml-copy", "my_data.MyData"] for line in proc.stdout.splitlines())
    assert "softmax-copy+ on movielens-100k" in proc.stdout
    assert "space 500 {} ['model.lr']" in proc.stdout
    assert "default alpha 0.9" in proc.stdout  # read from the entry point's DataModule


@pytest.mark.integration
def test_an_entry_point_may_not_take_a_packaged_name(root_and_tmp) -> None:
    root, tmp = root_and_tmp
    folder = write_plugin(tmp / "plugin", "[mtmoe.gates]\ncomet = my_gates:SoftmaxCopyGate\n")
    proc = run("from mtmoe.cli import main; main(['gates'])", tmp, f"{PACKAGE.parent}:{folder}", root)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: the entry point 'comet' of my-plugin (group mtmoe.gates) takes the name of "
        "mtmoe.gates.comet:COMETGate: rename it in that distribution's entry points"]
