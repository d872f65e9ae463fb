"""Trial packs against today's one-trial path, on MovieLens-100K (batch 512, 16 experts, the paper's settings).

    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py                       # CPU: comet, P in 1,2,4,8
    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py --gates comet,topk,softmax,comet+ --packs 1,4,16,64 \\
        --device cuda --study 64x5 --study-pack auto                               # a GPU
    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py --precision bf16-mixed --bf16-check 4
    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py --packs 1 --floor

1. **Trial-epochs per hour.** Today's path is one Lightning ``fit`` of one configuration (``build_run(...).fit()``,
   what an unpacked ``tune`` trial runs); its rate is 3600 / (the second epoch's time, training and validation).
   A pack of P trains P configurations of the gate's search space (the study's plan, seed 0) with
   :class:`mtmoe.pack.train.PackTrainer`; its rate is P x 3600 / (the second pack epoch's time, training and
   validation of all P). Both run in this process, one after the other, for every gate; the ratio is the speed-up.
   "+" gates are timed inside their permutation window (E_perm >= the epochs timed), the costlier phase.
2. **Memory per trial.** On a GPU, :func:`mtmoe.pack.train.memory_per_trial` (measured peaks); on a CPU, the
   pack's tensors per trial (parameters, gradients, Adam's two moments, the best-weights snapshot).
3. **A whole small study** (``--study NxE``): ``python -m mtmoe tune --trials N --trainer.max_epochs E`` of the
   first gate, packed (``--pack --study-pack``) and unpacked (``--pack 1``), each a fresh journal storage; wall
   time of the whole command, and the two studies' objectives, configuration by configuration (the same plan;
   dropout draws differ): their means and a paired t-test.
4. **bf16** (``--bf16-check P``): the same P configurations trained for ``--epochs`` epochs in fp32, in fp32 with
   other seeds (seed noise) and in bf16-mixed; mean absolute difference of their test losses.
5. **The matmul floor** (``--floor``): the expert layer's three matmuls (forward and the two gradients) of one
   MovieLens step, timed alone in fp32 and in bf16, times the steps of an epoch: what no trial-epoch can undercut.

Prints Markdown tables and writes them with a JSON copy to ``benchmarks/out/packs.{md,json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtmoe.files import write_atomic

OUT = Path(__file__).resolve().parent / "out"
DATA = "movielens-100k"


def configurations(gate: str, n: int, epochs: int) -> list[list[str]]:
    """``fit`` arguments of the study's first n planned configurations of ``gate``, ``epochs`` epochs each."""
    from mtmoe.tuning.space import SearchSpace, load_space
    from mtmoe.tuning.objective import cli_args, plan_configurations

    space = load_space(DATA, gate)
    space = SearchSpace(space.data, space.gate, n, space.fixed, space.distributions)
    scratch = Path(tempfile.mkdtemp())
    runs = []
    for config_id, params in enumerate(plan_configurations(space, n, 0)):
        if gate.endswith("+"):
            params = {**params, "model.perm_epochs": epochs}  # the window covers every timed epoch
        runs.append(cli_args(space, params, [f"--trainer.max_epochs={epochs}", "--early_stopping.patience=1000"],
                             config_id, scratch / str(config_id)))
    return runs


def unpacked_epoch_seconds(args: list[str], accelerator: str) -> float:
    """The second epoch (training and validation) of one Lightning ``fit``."""
    from mtmoe.lit.callbacks import EpochTimer
    from mtmoe.run import build_run

    run = build_run([*args, f"--trainer.accelerator={accelerator}"])
    timer = EpochTimer()
    run.trainer.callbacks.append(timer)
    run.fit()
    return timer.seconds[1]


def packed_epoch_seconds(runs_args: list[list[str]], accelerator: str, precision: str) -> tuple[float, int]:
    """The second pack epoch (training and validation of every trial), and the pack's memory per trial in bytes."""
    from mtmoe.pack.train import PackTrainer, PackTrial, memory_per_trial
    from mtmoe.run import build_run

    runs = [build_run([*args, f"--trainer.accelerator={accelerator}"]) for args in runs_args]
    data, device = runs[0].datamodule, runs[0].trainer.strategy.root_device
    data.setup("fit")
    if device.type == "cuda":
        per_trial = memory_per_trial(runs[0].model, data.splits, data.batch_size, data.eval_batch_size, device,
                                     precision)
    else:
        per_trial = 5 * sum(p.numel() * p.element_size() for p in runs[0].model.net.parameters())
    trials = [PackTrial(i, run.model, run.datamodule.seed, run.trainer.max_epochs, 1000) for i, run in enumerate(runs)]
    trainer = PackTrainer(data.splits, data.batch_size, data.eval_batch_size, len(runs), device, precision)
    stamps = [time.perf_counter()]

    def on_epoch(_) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stamps.append(time.perf_counter())

    trainer.run(lambda: trials.pop(0) if trials else None, lambda result: None, on_epoch)
    return stamps[2] - stamps[1], per_trial


def expert_matmul_floor(precision: str, steps: int, repeats: int = 20) -> float:
    """Seconds per trial-epoch of the expert layer's three matmuls alone (forward, the two gradients) at MovieLens'
    shape ([512, 256] x [256, 16 x 256]) in ``precision``: no trial trains faster on this device's matmul kernel."""
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    x, w, g = (torch.randn(*shape).to(dtype) for shape in ((512, 256), (256, 4096), (512, 4096)))

    def step() -> None:
        x @ w, g @ w.T, x.T @ g

    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats * steps


def test_losses(runs_args: list[list[str]], accelerator: str, precision: str) -> list[float]:
    from mtmoe.pack.train import PackTrainer, PackTrial
    from mtmoe.run import build_run

    runs = [build_run([*args, f"--trainer.accelerator={accelerator}"]) for args in runs_args]
    data = runs[0].datamodule
    data.setup("fit")
    trials = [PackTrial(i, run.model, run.datamodule.seed, run.trainer.max_epochs, 1000) for i, run in enumerate(runs)]
    results = {}
    PackTrainer(data.splits, data.batch_size, data.eval_batch_size, len(runs), runs[0].trainer.strategy.root_device,
                precision).run(lambda: trials.pop(0) if trials else None,
                               lambda r: results.__setitem__(r.key, r.results["test"]["loss"]))
    return [results[i] for i in range(len(runs_args))]


def study(gate: str, trials: int, epochs: int, pack: str, accelerator: str, scratch: Path) -> tuple[float, dict]:
    """Wall time of a whole ``tune`` command on a fresh journal storage, and its objectives by config_id."""
    import optuna

    log = scratch / f"pack-{pack}.log"
    command = [sys.executable, "-m", "mtmoe", "tune", "--gate", gate, "--data", DATA, "--trials", str(trials),
               "--storage", f"journal:{log}", "--log-dir", str(scratch / "runs"), "--pack", pack,
               f"--trainer.max_epochs={epochs}", f"--trainer.accelerator={accelerator}"]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"tune failed: {proc.stderr[-2000:]}")
    seconds = time.perf_counter() - start
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(log)))
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    return seconds, {t.user_attrs["config_id"]: t.value for t in trials if t.value is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gates", default="comet")
    parser.add_argument("--packs", default="1,2,4,8", help="pack sizes P")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed"], help="the packs' precision")
    parser.add_argument("--study", default=None, help="NxE: a whole N-trial study of E epochs, packed and not")
    parser.add_argument("--study-pack", default="auto", help="--pack of the packed study")
    parser.add_argument("--bf16-check", type=int, default=0, help="P configurations to compare bf16 with fp32")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the bf16 check")
    parser.add_argument("--floor", action="store_true", help="the expert matmuls' time per trial-epoch (CPU)")
    args = parser.parse_args()
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    where = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"CPU {platform.machine()}, {torch.get_num_threads()} threads"
    header = f"MovieLens-100K, batch 512, 16 experts; {where}, torch {torch.__version__}; packs in {args.precision}"
    print(header, flush=True)
    rows, lines = [], ["| gate | path | P | epoch (s) | trial-epochs / hour | speed-up | memory / trial (MiB) |",
                       "|---|---|---|---|---|---|---|"]
    for gate in args.gates.split(","):
        packs = [int(p) for p in args.packs.split(",")]
        plan = configurations(gate, max(packs), 3)  # the second of three epochs: no trial ends in it
        base = unpacked_epoch_seconds(plan[0], accelerator)
        rows.append({"gate": gate, "path": "fit (today)", "P": 1, "epoch_s": base, "per_hour": 3600 / base})
        lines.append(f"| {gate} | fit (today) | 1 | {base:.2f} | {3600 / base:,.0f} | 1.00 | |")
        print(lines[-1], flush=True)
        for pack in packs:
            seconds, per_trial = packed_epoch_seconds(plan[:pack], accelerator, args.precision)
            rate = pack * 3600 / seconds
            rows.append({"gate": gate, "path": "pack", "P": pack, "epoch_s": seconds, "per_hour": rate,
                         "speed_up": rate * base / 3600, "memory_per_trial_bytes": per_trial})
            lines.append(f"| {gate} | pack | {pack} | {seconds:.2f} | {rate:,.0f} | {rate * base / 3600:.2f} | "
                         f"{per_trial / 2**20:.0f} |")
            print(lines[-1], flush=True)
    tables = [header, "", *lines]
    if args.study:
        trials, epochs = (int(x) for x in args.study.split("x"))
        gate = args.gates.split(",")[0]
        scratch = Path(tempfile.mkdtemp())
        from scipy.stats import ttest_rel

        packed, packed_values = study(gate, trials, epochs, args.study_pack, accelerator, scratch)
        unpacked, unpacked_values = study(gate, trials, epochs, "1", accelerator, scratch)
        ids = sorted(set(packed_values) & set(unpacked_values))
        pairs = [(packed_values[i], unpacked_values[i]) for i in ids]
        p_value = ttest_rel(*zip(*pairs)).pvalue
        rows.append({"study": args.study, "gate": gate, "packed_s": packed, "unpacked_s": unpacked,
                     "objectives": {"packed": packed_values, "unpacked": unpacked_values}})
        tables += ["", f"{gate}, {trials} trials x {epochs} epochs (`tune`, whole command): packed "
                   f"(--pack {args.study_pack}) {packed:.0f} s, unpacked {unpacked:.0f} s, {unpacked / packed:.2f}x; "
                   f"objectives of the {len(ids)} configurations: mean {statistics.mean(p for p, _ in pairs):.5f} "
                   f"packed, {statistics.mean(u for _, u in pairs):.5f} unpacked, paired t-test p = {p_value:.2f}"]
        print(tables[-1], flush=True)
    if args.bf16_check:
        gate = args.gates.split(",")[0]
        plan = configurations(gate, args.bf16_check, args.epochs)
        reseeded = [[a if not a.startswith("--seed_everything=") else f"--seed_everything={1000 + i}" for a in run]
                    for i, run in enumerate(plan)]
        fp32 = test_losses(plan, accelerator, "32")
        noise = test_losses(reseeded, accelerator, "32")
        start = time.perf_counter()
        bf16 = test_losses(plan, accelerator, "bf16-mixed")
        bf16_s = time.perf_counter() - start
        gap = statistics.mean(abs(a - b) for a, b in zip(fp32, bf16))
        seed_gap = statistics.mean(abs(a - b) for a, b in zip(fp32, noise))
        rows.append({"bf16_check": args.bf16_check, "fp32": fp32, "fp32_other_seeds": noise, "bf16": bf16})
        tables += ["", f"{gate}, {args.bf16_check} configurations x {args.epochs} epochs: mean |test loss bf16 - fp32| "
                   f"{gap * 100:.3f} x1e-2, against {seed_gap * 100:.3f} x1e-2 between two seeds in fp32 "
                   f"(bf16 pack: {bf16_s:.0f} s)"]
        print(tables[-1], flush=True)
    if args.floor:
        from mtmoe.run import build_run

        data = build_run(configurations("comet", 1, 1)[0]).datamodule
        data.setup("fit")
        steps = -(-len(next(iter(data.splits["train"].values()))) // data.batch_size)
        floors = {precision: expert_matmul_floor(precision, steps) for precision in ("32", "bf16-mixed")}
        rows.append({"floor_steps": steps, "floor_s": floors})
        tables += ["", f"Floor: the expert layer's three matmuls alone take {floors['32']:.2f} s per trial-epoch in "
                   f"fp32 and {floors['bf16-mixed']:.2f} s in bf16 ({steps} training steps)"]
        print(tables[-1], flush=True)
    OUT.mkdir(exist_ok=True)
    write_atomic("\n".join(tables) + "\n", OUT / "packs.md")
    write_atomic(json.dumps({"where": where, "rows": rows}, indent=2) + "\n", OUT / "packs.json")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
