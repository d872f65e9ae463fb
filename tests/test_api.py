"""The Python API (issue 22, item 6): ``import mtmoe`` stays light, ``build_model`` is the net ``fit`` builds, and
the "Python API" examples of docs/training.md run as written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtmoe
from conftest import run_cli
from mtmoe.errors import UsageError
from test_docs import code_blocks, section
from test_tuning import TINY

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "training.md"


@pytest.mark.integration
def test_import_mtmoe_imports_neither_torch_nor_lightning() -> None:
    code = "import sys, mtmoe; print([m for m in ('torch', 'lightning', 'optuna', 'pandas') if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout == "[]\n"
    assert mtmoe.list_gates()[0] == "comet"  # each name imports its module when first used
    assert set(mtmoe.__all__) <= set(dir(mtmoe))
    with pytest.raises(AttributeError, match="no attribute 'build_net'"):
        mtmoe.build_net  # noqa: B018


def test_build_model_is_the_net_fit_builds(tiny_root: Path) -> None:
    from mtmoe.run import build_run

    state = torch.get_rng_state()
    net = mtmoe.build_model("comet+", "movielens-100k", seed_everything=3, n_experts=8, gamma=0.5)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state is left as it was
    run = build_run(["--gate", "comet+", "--data", "movielens-100k", f"--data.root={tiny_root}", "--seed_everything=3",
                     "--model.n_experts=8", "--model.gate.gamma=0.5"])
    expected = run.model.net.state_dict()
    assert net.local_search.epochs == run.model.net.local_search.epochs == 5
    assert net.state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[key]) for key, value in net.state_dict().items())


@pytest.mark.parametrize("gate, settings, message", [
    ("comet", {"perm_epochs": 2}, "perm_epochs adds local search to comet: build_model('comet+', ...) for that"),
    ("topk", {"gamma": 1.0}, "unknown setting gamma; the model's: lr, alpha, n_experts, "),
    ("topk", {"gamma": 1.0}, "; the topk gate's: k, noisy"),
    ("comet+-", {}, "unknown gate 'comet+-'; valid gates: comet, "),
    ("competesmoe+", {}, "gate 'competesmoe' has no local-search ('+') variant"),
])
def test_build_model_refuses_bad_settings_in_one_line(gate: str, settings: dict, message: str) -> None:
    with pytest.raises(UsageError) as error:
        mtmoe.build_model(gate, "movielens-100k", **settings)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_python_api_examples_run(tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The section's examples, in one namespace as in a notebook, on a tiny MovieLens-100K and a one-trial study."""
    monkeypatch.setenv("MTMOE_DATA", str(tiny_root))
    assert run_cli(["tune", "--gate", "topk", "--data", "movielens-100k", "--trials", "1", "--pack", "1", *TINY]) == 0
    blocks = code_blocks(section(GUIDE.read_text(), "Python API"), "python")
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)  # noqa: S102
    assert namespace["plus"] is True and namespace["cls"].registry_name == "comet"
    assert namespace["weights"].shape == (len(namespace["batch"]["user"]), 8)
    table = namespace["table"]
    assert list(table["study"]) == ["movielens-100k/topk"] and table["objective"].notna().all()
    assert namespace["best"]["config_id"] == 0
    with pytest.raises(UsageError, match="^no studies named 'nope' in sqlite:///studies/optuna.db "):
        mtmoe.trials("sqlite:///studies/optuna.db", study="nope")
    with pytest.raises(UsageError, match=r"its studies are of movielens-100k; did you mean movielens-100k/topk\?\)$"):
        mtmoe.trials("sqlite:///studies/optuna.db", study="movielens-100k/topkk")
