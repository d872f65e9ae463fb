"""``studies/books.yaml`` and ``studies/jester.yaml`` against Supplement S1.3 (comet-protocol.md §6)."""
from __future__ import annotations

import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from mtmoe.gates import gate_variants
from mtmoe.tuning.space import load_space, space_file

# dataset -> (n, k, gamma grid, COMET+ gamma, entropy grid, DSelect-k zeta), S1.3 and §6's fixed settings
PAPER = {
    "books": (9, 4, [0.1, 0.5, 1, 5, 10], 0.5, [1, 5, 10, 50, 100], 10.0),
    "jester": (16, 2, [0.001, 0.02, 0.1, 1, 5, 10], 0.01, [0.05, 0.1, 0.5, 1, 5, 10], 1.0),
}
# the COMET paper's gates, first in each file in S1.3's order; other sections follow, and a gate without one is
# searched over its own defaults
GATES = ["softmax", "hash", "topk", "dselect", "comet", "comet+", "topk+", "hash+", "softmax+", "dselect+"]


@pytest.mark.parametrize("data", PAPER)
def test_search_space_is_s1_3(data: str) -> None:
    n, k, gammas, comet_plus_gamma, entropies, dselect_zeta = PAPER[data]
    document = yaml.safe_load(space_file(data).read_text())
    assert list(document["gates"])[:len(GATES)] == GATES and document["data"] == data
    assert set(document["gates"]) <= set(gate_variants())
    for gate in gate_variants():
        space = load_space(data, gate)
        assert space.trials == 500
        assert {key: space.fixed[key] for key in ("data.batch_size", "trainer.max_epochs",
                                                  "early_stopping.patience", "model.n_experts")} == {
            "data.batch_size": 2048, "trainer.max_epochs": 100, "early_stopping.patience": 25, "model.n_experts": n}
        assert space.distributions["model.lr"] == FloatDistribution(5e-5, 5e-4, log=True)
        assert "model.alpha" not in space.fixed and "model.alpha" not in space.distributions  # one study per alpha
        base = gate.removesuffix("+")
        if base in ("topk", "dselect", "comet"):
            assert space.fixed["model.gate.k"] == k
        if base in ("dselect", "comet") and gate != "comet+":
            assert space.distributions["model.gate.gamma"] == CategoricalDistribution(gammas)
        if base in ("dselect", "comet"):
            assert space.distributions["model.gate.entropy_reg"] == CategoricalDistribution(entropies)
        if base == "dselect":
            assert space.fixed["model.gate.zeta"] == dselect_zeta
        if gate.endswith("+"):
            assert space.distributions["model.perm_epochs"] == IntDistribution(1, 10)
            assert space.fixed["model.zeta"] == 1e-4
        else:
            assert not any(key.startswith("model.perm") or key == "model.zeta"
                           for key in [*space.fixed, *space.distributions])
        if base in ("softmax", "hash"):
            assert set(space.distributions) == {"model.lr"} | ({"model.perm_epochs"} if gate.endswith("+") else set())
    assert load_space(data, "comet+").fixed["model.gate.gamma"] == comet_plus_gamma
