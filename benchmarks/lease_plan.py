"""How many of a study's waiting trials one lease's study call completes, by pack size: a model, to choose
``gpu_check.py``'s pack and drain from what earlier leases measured (an estimate, not a measurement).

    python benchmarks/lease_plan.py                     # the kept journal and logs of docs/results/gpu-*/
    python benchmarks/lease_plan.py --packs 128,256 --drains 120,200 --total 585
    python benchmarks/lease_plan.py --packs 128,256 --steps study --lease 585,200   # a lease's two calls as well

* **Epochs per trial**: the Kaplan-Meier estimate from the study's journal: a complete trial's epochs are an
  event, a failed (interrupted) trial's epochs so far a censored observation. The complete trials alone are biased
  short: the long ones are those a lease's end cut off.
* **A pack epoch's seconds**: ``a + b * P``, least squares over the study logs' progress lines (pairs of "pack
  epoch E done" lines at the same pack size P, after the first 3 epochs: the captures), the trials' set-ups, test
  passes and the pack's shrinking included as they happened. Printed beside it, the same intervals split three ways
  (:func:`epoch_costs`): what an epoch costs whatever P, what each trial adds, and what each trial that ends adds.
* **The call**: ``gpu_check.py run --steps S --total T``: the study's budget is T less 10 s and, where S has them,
  report's and bootstrap's (each with its kill grace); ``tune`` stops claiming ``drain`` seconds before its SIGTERM, which comes
  ``stop`` seconds before the budget's end; a trial unfinished then is lost (no checkpoints travel). The pack starts
  with ``min(P, waiting)`` trials, refills a freed slot while it may claim, and shrinks to its running trials once a
  quarter of it is free with nothing to claim (``mtmoe.lit.module``), as ``tune`` does.

Prints, per pack and drain, the trials completed (mean and 10th percentile over ``--draws`` simulated calls); with
``--lease T1,T2``, per pack, those a lease of two calls completes (``--steps preflight,study --total T1``, then
``--steps study,report,bootstrap --total T2``), the first call's interrupted trials continued in the second from the
device's checkpoints (its ``--drain 0``) or rerun from their first epoch (:func:`lease`).
"""
from __future__ import annotations

import argparse
import gzip
import random
import re
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check  # noqa: E402  (the lease's sizes; the kept folders' order)

RESULTS = gpu_check.ROOT / "docs" / "results"
ENDED = re.compile(r"\] (\d+)/\d+ done, .*pack of (\d+), pack epoch (\d+) done, elapsed (\d+)h(\d+)m(\d+)s")
STARTUP_S = 10.0  # tune's start before its first claim: the storage, the data, the plan
SETUP_S = 0.04  # a trial's claim, build and load into a slot (bench_packs.py --setup, this VM's order)
# gpu_check's preflight before the study, when --steps has it: pytest's start and the float32 epilogue and mixing
# CUDA tests (3.1 s and about as long on the H200: docs/results/gpu-2026-11-27-2's tests log), and the evaluation
# graphs' test (not yet run on a GPU: a guess of 15 s beyond the Triton compilations the study would pay anyway)
PREFLIGHT_S = 30


def trial_epochs(journal: Path, study: str) -> tuple[list[int], list[int]]:
    """The epochs of the complete trials and of the failed ones (so far) of the journal's ``study``."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as scratch:
        plain = Path(scratch) / "study.journal"
        plain.write_bytes(gzip.decompress(journal.read_bytes()) if journal.suffix == ".gz" else journal.read_bytes())
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(plain)))
        if study not in optuna.get_all_study_names(storage):
            held = [name.rpartition("/")[2] for name in optuna.get_all_study_names(storage)]
            sys.exit(f"error: {journal} holds no study {study!r} yet: give --gate {' or '.join(held)}")
        trials = optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)
    epochs = {state: [len(t.intermediate_values) for t in trials if t.state.name == state]
              for state in ("COMPLETE", "FAIL")}
    return epochs["COMPLETE"], [e for e in epochs["FAIL"] if e > 0]


def kaplan_meier(events: list[int], censored: list[int]) -> list[tuple[int, float]]:
    """``(epochs, probability)`` of a trial's epochs: the Kaplan-Meier estimate's steps; the mass left after the last
    event goes to the last event's epochs (a trial stops at ``max_epochs`` at most)."""
    survival, steps = 1.0, []
    times = sorted(set(events))
    for time in times:
        at_risk = sum(e >= time for e in events) + sum(c >= time for c in censored)
        ended = events.count(time)
        steps.append((time, survival * ended / at_risk))
        survival *= 1 - ended / at_risk
    last, mass = steps[-1]
    steps[-1] = (last, mass + survival)
    return steps


def intervals(logs: list[str]) -> list[tuple[int, int, int, int]]:
    """The logs' intervals between consecutive "pack epoch E done" lines at one pack size P, after the first 3
    epochs (the captures): ``(P, epochs, seconds, trials done in it)`` each."""
    out = []
    for log in logs:
        lines = [(int(done), int(p), int(e), 3600 * int(h) + 60 * int(m) + int(s))
                 for done, p, e, h, m, s in ENDED.findall(log)]
        for (d0, p0, e0, t0), (d1, p1, e1, t1) in zip(lines, lines[1:]):
            if p0 == p1 and e0 > 3 and e1 > e0:
                out.append((p1, e1 - e0, t1 - t0, d1 - d0))
    return out


def epoch_model(logs: list[str]) -> tuple[float, float, int]:
    """``a, b`` of a pack epoch's ``a + b * P`` seconds, least squares over the logs' intervals, and their number."""
    points = [point for p, epochs, seconds, _ in intervals(logs) for point in [(p, seconds / epochs)] * epochs]
    if len({p for p, _ in points}) < 2:
        sys.exit("error: the study logs hold epochs of fewer than 2 pack sizes: no model of a pack epoch's time")
    mean_p, mean_t = statistics.fmean(p for p, _ in points), statistics.fmean(t for _, t in points)
    b = (sum((p - mean_p) * (t - mean_t) for p, t in points) / sum((p - mean_p) ** 2 for p, _ in points))
    return mean_t - b * mean_p, b, len(points)


def epoch_costs(logs: list[str]) -> tuple[float, float, float, int]:
    """``a, b, c``: a pack epoch's ``a + b * P`` seconds plus ``c`` per trial that ends in it (its share of the
    epoch's test pass, its results told, the next trial's set-up), least squares over the intervals between the
    logs' consecutive "pack epoch E done" lines at one pack size (:func:`intervals`), and their number."""
    import numpy as np

    kept = [(p, epochs, seconds, done) for p, epochs, seconds, done in intervals(logs) if done >= 0]
    rows = [(epochs, epochs * p, done) for p, epochs, _, done in kept]
    seconds = [seconds for _, _, seconds, _ in kept]
    if len({p for p, _, _, _ in kept}) < 2:
        sys.exit("error: the study logs hold epochs of fewer than 2 pack sizes: no model of a pack epoch's time")
    (a, b, c), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(seconds, dtype=float), rcond=None)
    return float(a), float(b), float(c), len(rows)


def call(pack: int, waiting: list[int], running: list[list[int]], claim_s: float, stop_s: float, a: float,
         b: float) -> int:
    """One ``gpu_check`` call's study, ``tune``'s way: trials that ``running`` holds (``[epochs left, epochs]``,
    continued from checkpoints) and ``waiting`` gives (epochs each, claimed from its end) train in a pack of at most
    ``pack``; trials complete until ``stop_s`` seconds; no claim after ``claim_s``. Both lists are left as the call
    leaves them (the trials in flight at its stop stay in ``running``). The trials completed."""
    now, capacity, done = STARTUP_S, min(pack, len(waiting) + len(running)), 0
    now += SETUP_S * len(running)

    def refill() -> None:
        nonlocal now
        while waiting and len(running) < capacity and now < claim_s:
            epochs = waiting.pop()
            running.append([epochs, epochs])
            now += SETUP_S

    refill()
    while running and now + a + b * capacity <= stop_s:
        now += a + b * capacity
        for trial in running:
            trial[0] -= 1
        done += sum(left == 0 for left, _ in running)
        running[:] = [trial for trial in running if trial[0]]
        refill()
        if 4 * (capacity - len(running)) >= capacity and not (waiting and now < claim_s):
            capacity = len(running)
    return done


def completed(pack: int, epochs: list[int], claim_s: float, stop_s: float, a: float, b: float) -> int:
    """Trials of ``epochs`` (in claim order) complete within ``stop_s`` seconds of a call."""
    return call(pack, list(epochs), [], claim_s, stop_s, a, b)


def lease(pack: int, epochs: list[int], calls: list[tuple[float, float]], a: float, b: float, resume: bool) -> int:
    """Trials of ``epochs`` complete over a lease's calls (``(claim_s, stop_s)`` each); the trials a call's stop
    interrupts continue in the next from their checkpoints (``resume``: the same warm machine) or rerun from their
    first epoch (claimed first, as a lost trial's configuration is)."""
    waiting, running, done = list(epochs), [], 0
    for claim_s, stop_s in calls:
        if not resume:
            waiting += [total for _, total in running]
            running = []
        done += call(pack, waiting, running, claim_s, stop_s, a, b)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--journal", type=Path, default=None,
                        help="the study's journal (.gz or plain; default: the newest kept in docs/results/gpu-*/)")
    parser.add_argument("--gate", default=gpu_check.STUDY_GATES[0], choices=gpu_check.STUDY_GATES,
                        help="the study of the journal to model: its trials left and their epochs")
    parser.add_argument("--packs", default="96,128,192,256")
    parser.add_argument("--drains", default=str(gpu_check.GPU.drain), help="tune stops claiming this long before "
                        "its SIGTERM, seconds (comma-separated to compare)")
    parser.add_argument("--total", type=int, default=585, help="gpu_check.py run --total of the call")
    parser.add_argument("--steps", default="study,report,bootstrap", help="gpu_check.py run --steps of the call "
                        "(report and bootstrap keep their budgets after the study)")
    parser.add_argument("--to-run", type=int, default=None, help="trials left to run (default: the study's "
                        "500 less its complete ones)")
    parser.add_argument("--epoch-s", default=None, help="A,B: a pack epoch's A + B x P seconds instead of the fit "
                        "to the logs (another GPU's, say)")
    parser.add_argument("--lease", default=None, metavar="T1,T2",
                        help="also a lease of two calls, --steps preflight,study --total T1 then --steps "
                             "study,report,bootstrap --total T2: its interrupted trials continued from the device's "
                             "checkpoints (the first call's --drain 0) or rerun (--drain 120 in both)")
    parser.add_argument("--draws", type=int, default=200)
    args = parser.parse_args()
    folders = sorted((p for p in RESULTS.glob("gpu-*") if p.is_dir()), key=lambda p: gpu_check.lease_order(p.name))
    journal = args.journal or gpu_check.newest_kept_journal(RESULTS, gpu_check.DEFAULT_STUDY)
    if journal is None or not journal.is_file():
        sys.exit(f"error: no study journal at {journal or RESULTS / 'gpu-*/study.journal.gz'}: give --journal PATH")
    logs = []
    for archive in (a for f in folders for a in sorted(f.glob("call*-logs.tar.gz"))):
        with tarfile.open(archive) as tar:
            logs += [tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith("study.log")]
    events, censored = trial_epochs(journal, gpu_check.study_name(args.gate))
    if not events:
        sys.exit(f"error: {gpu_check.study_name(args.gate)} has no complete trial in {journal} to draw the epochs "
                 f"of its trials from: model it with another --gate's and --to-run")
    waiting = args.to_run if args.to_run is not None else gpu_check.GPU.trials - len(events)  # failed ones rerun
    a, b, intervals = epoch_model(logs)
    if args.epoch_s is not None:
        a, b = (float(x) for x in args.epoch_s.split(","))
    distribution = kaplan_meier(events, censored)
    mean = sum(e * p for e, p in distribution)
    study_s = (args.total - gpu_check.SUMMARY_S
               - gpu_check.reserved_after("study", tuple(args.steps.split(",")), gpu_check.GPU.budgets))
    study_s -= PREFLIGHT_S if "preflight" in args.steps.split(",") else 0
    stop_s = study_s - gpu_check.GPU.stop
    print(f"{journal}: {len(events)} complete, {len(censored)} failed, {waiting} to run; epochs per trial "
          f"{statistics.fmean(events):.1f} (complete ones), {mean:.1f} (Kaplan-Meier)")
    fitted = "--epoch-s" if args.epoch_s is not None else f"{intervals} epochs of {len(logs)} study logs"
    print(f"a pack epoch: {a:.2f} + {b:.4f} x P seconds ({fitted}); "
          f"the study's {study_s} s, SIGTERM at {stop_s} s")
    fixed, per_trial, per_end, ended_intervals = epoch_costs(logs)
    print(f"of which: {fixed:.2f} + {per_trial:.4f} x P seconds an epoch, plus {per_end:.3f} s per trial that ends in "
          f"it (its share of the test pass, its results told, the next trial's set-up; {ended_intervals} intervals "
          "between the logs' epoch ends)")
    print("| pack | drain (s) | trials complete, mean | 10th percentile |\n|---|---|---|---|")
    rng = random.Random(0)
    values, weights = zip(*distribution)
    draws = [rng.choices(values, weights, k=waiting) for _ in range(args.draws)]
    for pack in (int(p) for p in args.packs.split(",")):
        for drain in (int(d) for d in args.drains.split(",")):
            done = sorted(completed(pack, epochs, stop_s - drain, stop_s, a, b) for epochs in draws)
            print(f"| {pack} | {drain} | {statistics.fmean(done):.0f} of {waiting} | {done[len(done) // 10]} |")
    if args.lease is None:
        return

    def stop(total: int, steps: tuple[str, ...]) -> float:
        budget = (total - gpu_check.SUMMARY_S - gpu_check.reserved_after("study", steps, gpu_check.GPU.budgets)
                  - (PREFLIGHT_S if "preflight" in steps else 0))
        return budget - gpu_check.GPU.stop

    first, second = (int(t) for t in args.lease.split(","))
    stops = stop(first, ("preflight", "study")), stop(second, ("study", "report", "bootstrap"))
    drain = gpu_check.GPU.drain
    print(f"\na lease: --steps preflight,study --total {first}, then --steps study,report,bootstrap --total {second}\n"
          "| pack | interrupted trials | trials complete, mean | 10th percentile |\n|---|---|---|---|")
    for pack in (int(p) for p in args.packs.split(",")):
        for resume in (True, False):
            calls = [(stops[0] - (0 if resume else drain), stops[0]), (stops[1] - drain, stops[1])]
            done = sorted(lease(pack, epochs, calls, a, b, resume) for epochs in draws)
            how = "continued (first call --drain 0)" if resume else f"rerun (--drain {drain})"
            print(f"| {pack} | {how} | {statistics.fmean(done):.0f} of {waiting} | {done[len(done) // 10]} |")


if __name__ == "__main__":
    main()
