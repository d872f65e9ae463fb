"""``fit``'s results on the real MovieLens-100K for every gate and "+" variant of the engine's rewrite (issue 21),
dropout off and on, at a short budget and a fixed seed, recorded and checked by ``tests/test_fit_regression.py``, so that a change of the
training engine that moves ``fit``'s results is seen.

Two records: ``tests/data/fit_regression.json``, of the training loop before the engine (commit 46207d7, Lightning's
automatic optimisation and ``torch.optim.Adam(fused=True)``), for the runs whose random draws did not change; and
``tests/data/fit_regression_streams.json``, of the engine, for the runs that draw from the per-trial random streams
since (dropout on, SparseMixer's sampling): ``python tests/fit_regression.py`` rewrites the second. Gates registered
after the engine have no record: their own tests hold them to their official code, and packed == alone to ``fit``.

The budget: 3 epochs of 16 training batches of 128 rows at learning rate 1e-3, 4 validation and 4 test batches
(``--trainer.limit_*``), seed 0, the dataset's other settings; "+" variants with E_perm = 2: the first epoch is
validated with the rounding of a soft permutation, the second ends the window (rounded and frozen before its last
step) and the third trains after it. ``MTMOE_DATA`` must point at a data root holding ``ml-100k/``.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "data" / "fit_regression.json"
STREAMS_RECORD = Path(__file__).resolve().parent / "data" / "fit_regression_streams.json"
BUDGET = ["--trainer.max_epochs=3", "--trainer.limit_train_batches=16", "--trainer.limit_val_batches=4",
          "--trainer.limit_test_batches=4", "--data.batch_size=128", "--model.lr=1e-3", "--seed_everything=0"]


def draws_from_streams(gate: str, dropout: bool) -> bool:
    """Whether the run draws random numbers in training (its record is the engine's)."""
    return dropout or gate.rstrip("+") == "sparsemixer"


def variants() -> list[str]:
    """The gates and "+" variants recorded before the engine (those registered at commit 46207d7)."""
    return sorted({key.split("/")[0] for key in json.loads(RECORD.read_text())})


def fit_results(gate: str, dropout: bool, log_dir: Path) -> dict:
    from mtmoe.run import build_run

    args = ["--data", "movielens-100k", "--gate", gate, *BUDGET, f"--trainer.logger.init_args.save_dir={log_dir}",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.enable_checkpointing=false"]
    if not dropout:
        args.append("--model.expert_dropout=0")
    if gate.endswith("+"):
        args.append("--model.perm_epochs=2")
    results = build_run(args).fit()
    out = {"epochs_run": results["epochs_run"], "best_epoch": results.get("best_epoch"),
           "best_val_loss": results.get("best_val_loss")}
    for split in ("val", "test"):  # the best epoch's validation and the test of its weights: every metric
        out[split] = results[split]
    if "permutation" in results:
        out["permutation"] = results["permutation"]["assignment"]
    return out


def main() -> None:
    """Record the runs that draw from the random streams (``STREAMS_RECORD``)."""
    record = {}
    with tempfile.TemporaryDirectory() as scratch:
        for gate in variants():
            for dropout in (False, True):
                if draws_from_streams(gate, dropout):
                    key = f"{gate}/dropout={'on' if dropout else 'off'}"
                    record[key] = fit_results(gate, dropout, Path(scratch))
                    print(key, record[key]["test"]["loss"], flush=True, file=sys.stderr)
    STREAMS_RECORD.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
