"""``benchmarks/lease_plan.py``, the model that chooses a lease's study pack (``gpu_check.study_args``): its parts
on cases worked by hand, and the script on the study journal and logs kept in ``docs/results/``."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lease_plan  # noqa: E402


def test_kaplan_meier_is_the_empirical_distribution_without_censoring_and_moves_mass_past_a_censored_trial() -> None:
    assert lease_plan.kaplan_meier([30, 40, 40, 50], []) == [(30, 0.25), (40, 0.5), (50, 0.25)]
    # a trial cut off at 45 epochs ran longer than 30 and 40: its share goes to 50, the one event past it
    steps = dict(lease_plan.kaplan_meier([30, 40, 50], [45]))
    assert steps == pytest.approx({30: 0.25, 40: 0.25, 50: 0.5})
    assert sum(steps.values()) == pytest.approx(1.0)


def test_a_pack_epoch_model_is_fitted_to_the_progress_lines() -> None:
    line = "[d/g] 0/9 done, 0 failed, best n/a, {p} running in a pack of {p}, pack epoch {e} done, elapsed 00h{m:02d}m{s:02d}s"
    seconds = {100: 3.0, 200: 5.0}  # a + b P: a = 1, b = 0.02
    logs = []
    for pack, epoch_s in seconds.items():
        logs.append("\n".join(line.format(p=pack, e=e, m=int(e * epoch_s) // 60, s=int(e * epoch_s) % 60)
                              for e in range(4, 14)))
    a, b, intervals = lease_plan.epoch_model(logs)
    assert (a, b, intervals) == (pytest.approx(1.0), pytest.approx(0.02), 18)


def test_an_epoch_cost_model_separates_the_trials_that_end() -> None:
    """Epochs of 1 + 0.02 P seconds, and 0.5 s more for each trial that ends in one (2 every third epoch)."""
    line = ("[d/g] {d}/99 done, 0 failed, best 1, {p} running in a pack of {p}, pack epoch {e} done, "
            "elapsed 00h{m:02d}m{s:02d}s")
    logs = []
    for pack in (100, 200):
        seconds, done, lines = 0.0, 0, []
        for epoch in range(4, 40):
            ended = 2 if epoch % 3 == 0 else 0
            seconds, done = seconds + 1 + 0.02 * pack + 0.5 * ended, done + ended
            lines.append(line.format(d=done, p=pack, e=epoch, m=round(seconds) // 60, s=round(seconds) % 60))
        logs.append("\n".join(lines))
    a, b, c, intervals = lease_plan.epoch_costs(logs)
    assert intervals == 70
    assert (a, b, c) == (pytest.approx(1.0, abs=0.05), pytest.approx(0.02, abs=3e-4), pytest.approx(0.5, abs=0.05))


def test_the_simulated_call_completes_what_fits_before_its_stop() -> None:
    start = lease_plan.STARTUP_S + 2 * lease_plan.SETUP_S
    # two trials of 3 and 5 epochs in a pack of 2, epochs of 1 + 0 P seconds: done at start + 3 and start + 5
    assert lease_plan.completed(2, [3, 5], 1000, start + 5, 1.0, 0.0) == 2
    assert lease_plan.completed(2, [3, 5], 1000, start + 4.9, 1.0, 0.0) == 1
    # a pack of 1: the second trial waits for the slot, claimed only before claim_s
    assert lease_plan.completed(1, [3, 3], 1000, 1000, 1.0, 0.0) == 2
    assert lease_plan.completed(1, [3, 3], 0, 1000, 1.0, 0.0) == 0  # nothing claimed


def test_a_lease_continues_the_trials_its_first_call_interrupted_only_from_checkpoints() -> None:
    """A trial of 3 epochs, epochs of 1 s, each call stopping 2.5 s after its trials are loaded: the first call
    trains 2 epochs; the second finishes it from its checkpoint (1 epoch), or reruns it from its first epoch (3
    epochs: cut off again)."""
    stop = lease_plan.STARTUP_S + lease_plan.SETUP_S + 2.5
    calls = [(1000, stop), (1000, stop)]
    assert lease_plan.lease(1, [3], calls, 1.0, 0.0, resume=True) == 1
    assert lease_plan.lease(1, [3], calls, 1.0, 0.0, resume=False) == 0
    running = []  # what a call leaves in flight is the next call's to continue
    assert lease_plan.call(1, [3], running, 1000, stop, 1.0, 0.0) == 0 and running == [[1, 3]]


@pytest.mark.integration
def test_the_script_models_the_kept_study() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lease_plan.py"), "--packs", "128,256",
                             "--draws", "20", "--lease", "585,200"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) of (\d+) \| (\d+) \|$", result.stdout, re.M)
    assert [int(r[0]) for r in rows] == [128, 256], result.stdout
    assert all(int(r[4]) <= int(r[2]) <= int(r[3]) for r in rows), rows
    assert re.search(r"epochs per trial \d+\.\d \(complete ones\), \d+\.\d \(Kaplan-Meier\)", result.stdout)
    leases = re.findall(r"^\| (\d+) \| (continued|rerun) .* \| (\d+) of (\d+) \| (\d+) \|$", result.stdout, re.M)
    assert [(int(r[0]), r[1]) for r in leases] == [(128, "continued"), (128, "rerun"), (256, "continued"),
                                                    (256, "rerun")], result.stdout
    assert re.search(r"^of which: \d+\.\d\d \+ \d\.\d{4} x P seconds an epoch, plus \d\.\d{3} s per trial that ends",
                     result.stdout, re.M), result.stdout
