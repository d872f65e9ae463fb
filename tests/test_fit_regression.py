"""``fit`` reproduces its recorded results (``tests/fit_regression.py``: every registered gate and "+" variant on the
real MovieLens-100K, dropout off and on, a short budget, seed 0).

The runs that draw no random number in training (dropout off; SparseMixer samples) are checked against the record of
the training loop before the engine (commit 46207d7): the engine reproduces them (to float32 rounding on the
recording host). The others draw from the per-trial random streams since issue 25 and are checked against the
engine's own record.

Tolerances are those of another CPU. The records were made on an AMD EPYC; an Intel Xeon (both AVX-512, MKL) rounds
float32 products differently and 48 Adam steps amplify it: measured there, losses and MSE within 2.5e-4 relative,
AUC 1.4e-3, accuracy 5 rows of the 512 evaluated, other statistics 2e-3 (on the recording host: 2.6e-6, AUC
6.6e-5). The tolerances are twice those; epochs, best epoch and the rounded permutation stay exact on both. The
equivalence tests (a packed trial against its run alone, graphs against eager) are exact on any host.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mtmoe.routing_names import routing_of
from fit_regression import RECORD, STREAMS_RECORD, draws_from_streams, fit_results, variants

DATA = Path(os.environ.get("MTMOE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DATA / "ml-100k" / "u.data").exists(),
                                                   reason="needs the real MovieLens-100K (MTMOE_DATA)")]


def tolerance(key: str) -> dict:
    if key.endswith("accuracy"):
        return {"rel": 0, "abs": 10 / 512}
    if key.endswith("auroc"):
        return {"rel": 0, "abs": 3e-3}
    if "loss" in key or key.endswith("mse"):
        return {"rel": 5e-4, "abs": 0}
    return {"rel": 0, "abs": 4e-3}


@pytest.mark.parametrize("dropout", ["off", "on"])
@pytest.mark.parametrize("gate", variants())
def test_fit_reproduces_its_recorded_results(gate: str, dropout: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MTMOE_DATA", str(DATA))
    record = STREAMS_RECORD if draws_from_streams(gate, dropout == "on") else RECORD
    expected = json.loads(record.read_text())[f"{gate}/dropout={dropout}"]
    got = fit_results(gate, dropout == "on", tmp_path)
    assert (got["epochs_run"], got["best_epoch"]) == (expected["epochs_run"], expected["best_epoch"])
    assert got.get("permutation") == expected.get("permutation")
    assert got["best_val_loss"] == pytest.approx(expected["best_val_loss"], **tolerance("loss"))
    # The routing statistics (issue 35) are newer than the records: present, not compared here (their packed-equals-
    # alone and reference tests are in tests/test_routing_statistics.py and tests/test_pack_metrics.py).
    assert routing_of(got["val"]), "fit recorded no routing statistics"
    for split in ("val", "test"):
        got[split] = {key: value for key, value in got[split].items() if key not in routing_of(got[split])}
        assert set(got[split]) == set(expected[split]), split
        for key, value in expected[split].items():
            assert got[split][key] == pytest.approx(value, **tolerance(key)), (split, key)
