"""The training engine on MovieLens-100K (batch 512, 16 experts, the paper's settings): packs of P trials against
one trial, operation counts, per-trial set-up, a whole study.

    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py --gates comet,topk,comet+ --packs 1,4,8
    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py --device cuda --gates comet --packs 1,64,256,512 \\
        --graphs on,off --adam fused,elementwise
    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py --ops --gates comet,comet+ --packs 1,16
    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py --setup 16 --study 64x3 --study-pack 8
    MTMOE_DATA=../shared/data python benchmarks/bench_packs.py --roofline --gates comet,comet+,topk --packs 1,256

1. **Trial-epochs per hour** (``--packs``): P configurations of the gate's search space (the study's plan, seed 0)
   trained as a pack through the engine inside Lightning, exactly as ``tune --pack P`` trains them
   (:class:`mtmoe.lit.module.PackModule`); the rate is P x 3600 / (the fifth pack epoch's time, training and
   validation of all P, and the epoch's end; no trial ends in it, as in most epochs of a study, where each trial's
   test pass comes once in its tens of epochs; on a GPU every validation batch is replayed from its CUDA graph by
   then, captured in the fourth). P = 1 is ``fit``'s engine (``tune --pack 1``). "+" gates are timed
   inside their permutation window (E_perm >= the epochs timed), the costlier phase. ``--graphs on,off`` on a GPU:
   with the training step and the validation batches captured in CUDA graphs and without; ``--adam
   fused,elementwise``: Adam in one kernel for all trials and in element-wise torch operations
   (:class:`mtmoe.pack.adam.PackedAdam`). Device memory per trial (GPU) from
   :func:`mtmoe.pack.memory.memory_per_trial`. After the table, one line per row, ``phases gate=G P=P
   graphs=X adam=Y between_s=... train_s=... val_s=... end_s=... train_steps=N val_batches=M val_eager=...``: where
   that epoch's seconds went (:data:`EPOCH_PHASES`), and the third epoch's validation, whose batches all ran eagerly
   (before their capture). ``--profile-epoch``: the host's time in the sixth epoch, by Python function
   (``cProfile``; on a GPU, waiting for the device shows in the function that reads a device value): the
   functions with the most cumulative and own time after the table, every function in ``epoch-profile-*.prof``
   in ``--out`` (``python -m pstats``).
2. **Operations** (``--ops``): for each gate and P, one line per phase, ``ops gate=G P=P phase=X ops=N
   host_reads=R``: the ATen operations one training step (``train``; ``window`` and ``after`` for "+": inside the
   permutation window and after it) or one evaluation batch (``eval``) dispatches after warm-up, and how many of them
   read a device value on the host (:mod:`mtmoe.pack.operations`); on batches of 8 rows (the counts do not depend
   on the rows).
3. **Per-trial set-up** (``--setup N``): a trial claimed from a real SQLite study, built from its planned values by
   :class:`mtmoe.tuning.packs.TrialFactory` and loaded into a slot: mean milliseconds over N trials.
4. **A whole study** (``--study NxE``): the ``tune`` command, packed (``--study-pack``) and ``--pack 1``, each on a
   fresh journal storage: wall time, and the objectives configuration by configuration (equal to float32 rounding:
   each trial draws from its own random stream whatever its pack); then one line ``trial-host pack=P
   refill_ms_per_trial=... results_ms_per_trial=...``: what the packed study's epoch ends spent on the host (its
   ``pack-epochs.csv``) claiming, setting up and loading each trial of a refill, and recording and telling each
   trial's results (with tiny trials, ``--trial-args``, the host's share shows as on a GPU).
5. **The matmul floor** (``--floor``): the expert layer's three matmuls of one step alone, per trial-epoch.
6. **Where a step's time goes** (``--profile P[,P...]``, with ``--device``, ``--precision``, ``--matmul-precision`` and
   ``--trial-args``): a pack of P's eager training step on 512-row batches, one line ``profile gate=G P=P
   device=D precision=Y step_ms=... profiled_step_ms=... [kernel_ms=... kernels=...] adam_fused_ms=...
   adam_elementwise_ms=...`` (on a GPU, ``kernel_ms`` and ``kernels``: the device time of the step's kernels and
   their number, what a CUDA graph of the step replays, to set beside ``--roofline``'s projection), then
   ``torch.profiler``'s table of the operations (CPU) or kernels (GPU) with the most self time.
7. **Device cost without the device** (``--roofline``): for each gate and P, per phase (``train``: a training step on
   512-row batches, inside the permutation window for "+"; ``eval``: an evaluation batch) and precision (``fp32``,
   ``tf32``: the same operations, another matrix rate; ``bf16``: under bf16 autocast), one line ``roofline gate=G
   P=P phase=X precision=Y flops=F bytes=N launches=L projected_ms=T floor_ms=T0``, counted on this CPU by
   :mod:`mtmoe.pack.roofline` and projected on an H100; per gate, P and precision, ``trial-epoch gate=G P=P data=D
   precision=Y projected_ms=T``: an epoch's training steps and validation batches projected, per trial (a study's
   cost per trial-epoch, to set against another dataset's, ``--data``); then the bytes of each training step by
   kernel. The definitions (what is counted, the rates, the floor) are in ``benchmarks/README.md``.
8. **A test pass** (``--test-pass K[,K...]``, with ``--device`` and ``--trial-args``): the test split's pass of K
   trials that ended (:meth:`mtmoe.pack.engine.PackEngine.test`, what a pack runs for the trials it tests together),
   one line ``test-pass gate=G K=K device=D batches=N ms=T`` each (median of 3, after one warm-up pass;
   ``--limit-batches``: the first N test batches).

Prints the tables and writes them with a JSON copy to ``benchmarks/out/packs.{md,json}``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtmoe.files import write_atomic
from mtmoe.gate_names import split_gate_name
from mtmoe.pack.graphs import EAGER_CALLS
from mtmoe.pack.precision import matmul_precision

OUT = Path(__file__).resolve().parent / "out"
DATA = "movielens-100k"


def plan(gate: str, n: int, epochs: int, dataset: str = DATA) -> list[dict]:
    """The study's first n planned configurations of ``gate`` on ``dataset`` (seed 0), each trained ``epochs``
    epochs."""
    from mtmoe.tuning.objective import plan_configurations
    from mtmoe.tuning.space import load_space

    space = load_space(dataset, gate)
    configurations = []
    for params in plan_configurations(space, n, 0):
        if split_gate_name(gate)[1]:
            params = {**params, "model.perm_epochs": epochs}  # the window covers every timed epoch
        configurations.append({**params, "trainer.max_epochs": epochs})
    return configurations


def factory(gate: str, params: dict, device: str, precision: str, extra: tuple[str, ...] = (),
            dataset: str = DATA):
    from mtmoe.run import build_run
    from mtmoe.tuning.objective import cli_args
    from mtmoe.tuning.packs import TrialFactory
    from mtmoe.tuning.space import load_space

    space = load_space(dataset, gate)
    accelerator = "gpu" if device == "cuda" else "cpu"
    args = cli_args(space, params, [f"--trainer.accelerator={accelerator}", f"--trainer.precision={precision}",
                                    "--early_stopping.patience=1000", *extra], 0, Path(tempfile.mkdtemp()))
    return TrialFactory(build_run(args))


#: The parts of a pack epoch ``pack_epoch_seconds`` times, in their order: from the previous epoch's end to this
#: one's first batch (Lightning's loop, the batches' order), the training steps, the validation of every slot,
#: and the epoch's end (early stopping, best weights, finished trials' tests, the free slots refilled).
EPOCH_PHASES = ("between", "train", "val", "end")


def pack_epoch_seconds(gate: str, pack: int, device: str, precision: str, graphs: bool, fused_adam: bool = True,
                       limit_batches: int | None = None, trial_args: tuple[str, ...] = (),
                       profile: Path | None = None) -> tuple[float, dict[str, float], dict[str, int]]:
    """The fifth pack epoch (training and validation of every slot, and the epoch's end) of P planned
    configurations, in seconds, its :data:`EPOCH_PHASES` (seconds each, summing to it) and its batch counts
    (``train_steps``, ``val_batches``) and ``val_eager``, the third epoch's validation seconds (its batches
    dispatched eagerly: :class:`~mtmoe.pack.graphs.CapturedStep` captures each in its fourth call); no trial ends in
    them (they are planned for more epochs). ``limit_batches`` and ``trial_args`` (``fit`` options) shrink them
    (``gpu_check.py --dry-run``); ``profile``: a sixth epoch runs under ``cProfile``, its statistics written there."""
    import cProfile

    import lightning.pytorch as pl

    from mtmoe.lit.module import PackModule

    eager, timed = EAGER_CALLS, EAGER_CALLS + 2  # the last eager validation; the first replayed in full
    last = timed + 1 if profile is not None else timed
    configurations = plan(gate, pack, last + 1)
    trials = factory(gate, configurations[0], device, precision, trial_args)
    queue = [trials.build(i, params, i) for i, params in enumerate(configurations)]
    data = trials.run.datamodule
    data.prepare_data()
    data.setup("fit")
    stamps: list[list[float]] = []  # per epoch: its first batch, its validation's start and end, its end
    counts = {"train_steps": 0, "val_batches": 0}
    profiler = cProfile.Profile()

    def now() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    class Stamps(pl.Callback):
        def on_train_epoch_start(self, trainer, module) -> None:
            stamps.append([now()])
            if len(stamps) == timed + 1 and profile is not None:
                profiler.enable()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            counts["train_steps"] += len(stamps) == timed

        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
            counts["val_batches"] += len(stamps) == timed

        def on_validation_epoch_start(self, trainer, module) -> None:
            stamps[-1].append(now())

        def on_validation_epoch_end(self, trainer, module) -> None:
            stamps[-1].append(now())

    def on_epoch(module: PackModule) -> None:
        stamps[-1].append(now())
        if len(stamps) == last:
            profiler.disable()
            module.trainer.should_stop = True

    module = PackModule(data.info, data.splits, data.batch_size, data.eval_batch_size, pack,
                        lambda: queue.pop(0) if queue else None, lambda result: None, on_epoch, graphs, fused_adam)
    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, precision=precision,
                         max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Stamps()],
                         limit_train_batches=limit_batches, limit_val_batches=limit_batches,
                         limit_test_batches=limit_batches)
    trainer.fit(module)
    previous_end, (start, val_start, val_end, end) = stamps[timed - 2][-1], stamps[timed - 1]
    phases = dict(zip(EPOCH_PHASES, (start - previous_end, val_start - start, val_end - val_start, end - val_end)))
    if profile is not None:
        profiler.dump_stats(profile)
    return end - previous_end, phases, {**counts, "val_eager": stamps[eager - 1][2] - stamps[eager - 1][1]}


def epoch_profile_lines(path: Path, top: int) -> list[str]:
    """The ``top`` functions of a ``cProfile`` dump by cumulative and by own time, as ``pstats`` prints them."""
    import io
    import pstats

    lines = []
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(str(path), stream=text).strip_dirs().sort_stats(order).print_stats(top)
        lines += [f"epoch-profile by {order}:", *(line for line in text.getvalue().splitlines()[5:] if line.strip())]
    return lines


def loaded_engine(gate: str, pack: int, steps_per_epoch: int, device: str = "cpu", trial_args: tuple[str, ...] = (),
                  dataset: str = DATA):
    """An eager engine with P planned configurations of ``dataset`` loaded (``trial_args``: ``fit`` options of every
    trial), and the dataset's DataModule (set up)."""
    from mtmoe.pack.engine import PackEngine

    configurations = plan(gate, pack, 1, dataset)
    trials = factory(gate, configurations[0], device, "32", trial_args, dataset)
    pack_trials = [trials.build(i, params, i) for i, params in enumerate(configurations)]
    data = trials.run.datamodule
    data.prepare_data()
    data.setup("fit")
    engine = PackEngine(pack_trials[0].net, data.info.tasks, pack, device, cuda_graphs=False)
    engine.set_steps_per_epoch(steps_per_epoch)
    for slot, trial in enumerate(pack_trials):
        engine.load(slot, trial)
    return engine, data


def operations(gate: str, pack: int, trial_args: tuple[str, ...] = ()) -> dict:
    from mtmoe.pack.operations import phases

    # a window of 4 steps: a step inside it, then after it
    engine, data = loaded_engine(gate, pack, 4, trial_args=trial_args)
    splits = data.splits
    index = torch.arange(8).expand(pack, -1)  # the count does not depend on the batch's rows: 8 keep it quick
    batch = {key: tensor[index] for key, tensor in splits["train"].items()}
    eval_batch = {key: tensor[:8] for key, tensor in splits["val"].items()}
    return phases(engine, batch, eval_batch)


def profile_step(gate: str, pack: int, device: str = "cpu", bf16: bool = False, trial_args: tuple[str, ...] = (),
                 steps: int = 3, adam_repeats: int = 20) -> tuple[dict, str]:
    """Where a pack of P's eager training step (512-row batches, or ``trial_args``' batch size) spends its time,
    after ``steps`` warm-up steps, under bf16 autocast or none: milliseconds per step without and with
    ``torch.profiler`` (mean of ``steps``), on a GPU the kernels' summed time and their number per step (what a CUDA
    graph of the step replays), the pack's Adam update alone by each of its kernels (median of ``adam_repeats``),
    and the profiler's table of the operations (CPU) or kernels (GPU) with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    engine, data = loaded_engine(gate, pack, 10**6, device, trial_args)
    splits = data.splits
    rows = len(next(iter(splits["train"].values())))
    index = torch.randint(rows, (pack, data.batch_size), generator=torch.Generator().manual_seed(0))
    batch = {key: tensor[index].to(device) for key, tensor in splits["train"].items()}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        for _ in range(steps):
            engine.train_step(batch)
        start = now()
        for _ in range(steps):
            engine.train_step(batch)
        result = {"step_ms": (now() - start) / steps * 1000}
        with profile(activities=activities) as profiler:
            start = now()
            for _ in range(steps):
                engine.train_step(batch)
            result["profiled_step_ms"] = (now() - start) / steps * 1000
    if cuda:
        kernels = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
        result["kernel_ms"] = sum(event.device_time_total for event in kernels) / 1000 / steps
        result["kernels"] = len(kernels) // steps
    for kernel in ("fused", "elementwise"):
        engine.adam.fused = kernel == "fused"
        times = []
        for _ in range(adam_repeats):
            start = now()
            engine.adam.step()
            times.append((now() - start) * 1000)
        result[f"adam_{kernel}_ms"] = sorted(times)[len(times) // 2]
    order = "self_device_time_total" if cuda else "self_cpu_time_total"
    return result, profiler.key_averages().table(sort_by=order, row_limit=20)


def roofline(gate: str, pack: int, bf16: bool, trial_args: tuple[str, ...] = (),
             dataset: str = DATA) -> dict[str, tuple]:
    """Per phase (``train``, ``eval``): the :class:`mtmoe.pack.roofline.Cost` of a pack of P's training step on
    the dataset's batches (inside the permutation window for "+") or evaluation batch, its floor's bytes, and the
    phase's batches in an epoch (the training split's, the validation split's), on this CPU
    under bf16 autocast or none. Every tensor of a step is a trial's own (linear in P) or shared (constant), so the
    cost at P is measured at P = 1 and 2 and extrapolated (``Cost.extrapolated``; tests/test_roofline.py checks it
    against a direct count)."""
    from mtmoe.experts import DenseExperts
    from mtmoe.pack.roofline import floor_bytes, measure, tensor_bytes

    costs = {}
    for size in (1, 2):
        engine, data = loaded_engine(gate, size, 10**6, trial_args=trial_args, dataset=dataset)
        experts = engine.template.experts
        if not isinstance(experts, DenseExperts):
            sys.exit(f"error: --roofline's floor counts dense experts, {gate} on {dataset} has "
                     f"{type(experts).__name__}")
        split = data.splits["train"]
        rows = len(next(iter(split.values())))
        index = torch.randint(rows, (size, data.batch_size), generator=torch.Generator().manual_seed(0))
        batch = {key: tensor[index] for key, tensor in split.items()}
        eval_batch = {key: tensor[:data.eval_batch_size] for key, tensor in data.splits["val"].items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            engine.train_step(batch)  # warm-up: vmapped functions built, kernels compiled
            train = measure(lambda: engine.train_step(batch))
            engine.prepare_evaluation()
            engine.eval_step(eval_batch)
            evaluation = measure(lambda: engine.eval_step(eval_batch))
        costs[size] = {"train": train, "eval": evaluation}
    parameters = engine.stack.flat.numel() // 2  # per trial, from the pack of 2
    activations = data.batch_size * (experts.in_features + experts.n_experts * experts.units) * (2 if bf16 else 4)
    batch_bytes = sum(tensor_bytes(t[0]) for t in batch.values())
    eval_bytes = sum(map(tensor_bytes, eval_batch.values()))
    batches = {phase: math.ceil(len(next(iter(data.splits[split_name].values()))) / batch_size)
               for phase, split_name, batch_size in (("train", "train", data.batch_size),
                                                     ("eval", "val", data.eval_batch_size))}
    return {"train": (costs[1]["train"].extrapolated(costs[2]["train"], pack - 1),
                      floor_bytes(pack * parameters, pack * batch_bytes, pack * activations, True), batches["train"]),
            "eval": (costs[1]["eval"].extrapolated(costs[2]["eval"], pack - 1),
                     floor_bytes(pack * parameters, eval_bytes, 0, False), batches["eval"])}


def setup_milliseconds(gate: str, n: int) -> float:
    """Claim (a real SQLite study), build and load a trial into a slot: the mean over n trials."""
    import optuna

    from mtmoe.pack.engine import PackEngine
    from mtmoe.tuning.objective import plan_configurations
    from mtmoe.tuning.packs import PackWorker
    from mtmoe.tuning.space import SearchSpace, load_space
    from mtmoe.tuning.storage import storage_for
    from mtmoe.tuning.study import enqueue_missing

    space = load_space(DATA, gate)
    space = SearchSpace(space.data, space.gate, n, space.fixed, space.distributions)
    configurations = plan_configurations(space, n, 0)
    scratch = Path(tempfile.mkdtemp())
    storage = storage_for(f"sqlite:///{scratch / 'setup.db'}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a scratch study: its "A new study created" line is
    study = optuna.create_study(study_name="setup", storage=storage)  # no figure of the benchmark
    enqueue_missing(study, space, configurations)
    worker = PackWorker(study, storage, space, [], 0, scratch, n, configurations)
    trials = factory(gate, configurations[0], "cpu", "32")
    data = trials.run.datamodule
    engine = PackEngine(trials.build(0, configurations[0], 0).net, data.info.tasks, 1, "cpu", cuda_graphs=False)
    engine.set_steps_per_epoch(308)
    start = time.perf_counter()
    for _ in range(n):
        optuna_trial, params, config_id = worker._claim(None)
        engine.slots[0] = None
        engine.load(0, trials.build((optuna_trial, config_id, config_id), params, config_id))
    seconds = (time.perf_counter() - start) / n
    worker.heartbeats.stop()
    return 1000 * seconds


def test_pass_milliseconds(gate: str, sizes: list[int], device: str, trial_args: tuple[str, ...],
                           limit: int | None = None) -> tuple[int, dict]:
    """A test pass of K released trials of a pack of max(sizes), each K, on the test split (its first ``limit``
    batches): the batches, and the median of 3 passes' milliseconds by K (after a warm-up pass)."""
    engine, data = loaded_engine(gate, max(sizes), 308, device, trial_args)
    engine.best = {name: tensor.clone() for name, tensor in engine.stack.tensors().items()}
    for _, trial in engine.running:
        trial.best_epoch, trial.epochs_run = 0, 1
    from mtmoe.lit.module import EvalBatches

    split = {key: tensor.to(device) for key, tensor in data.splits["test"].items()}
    batches = EvalBatches(split, data.eval_batch_size).batches[:limit]  # as a pack's test pass cuts them
    released = engine.release([slot for slot, _ in engine.running])

    def seconds(k: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.test(released[:k], batches)  # reads its metrics on the host: the device's work is done at its end
        return time.perf_counter() - start

    out = {}
    for k in sizes:
        seconds(k)
        out[k] = 1000 * sorted(seconds(k) for _ in range(3))[1]
    return len(batches), out


def study(gate: str, trials: int, epochs: int, pack: str, device: str, scratch: Path,
          trial_args: tuple[str, ...] = ()) -> tuple[float, dict]:
    """Wall time of a whole ``tune`` command on a fresh journal storage (``trial_args``: its overrides), and its
    objectives by config_id."""
    import optuna

    log = scratch / f"pack-{pack}.log"
    command = [sys.executable, "-m", "mtmoe", "tune", "--gate", gate, "--data", DATA, "--trials", str(trials),
               "--storage", f"journal:{log}", "--log-dir", str(scratch / f"runs-{pack}"), "--pack", pack,
               f"--trainer.max_epochs={epochs}", f"--trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}",
               *trial_args]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"tune failed: {proc.stderr[-2000:]}")
    seconds = time.perf_counter() - start
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(log)))
    (name,) = optuna.get_all_study_names(storage)
    done = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    return seconds, {t.user_attrs["config_id"]: t.value for t in done if t.value is not None}


def trial_host_milliseconds(log_dir: Path, trials: int) -> dict[str, float]:
    """What the pack epoch ends of a one-worker study of ``trials`` trials and one structure (one pack) spent on the
    host per trial, from its ``pack-epochs.csv`` under ``log_dir``: the refills (claims, set-ups, loads into slots)
    per trial claimed in them (all but the pack's first fill), and the results told (logs, user attributes,
    ``tell``) per trial tested."""
    import pandas as pd

    (path,) = log_dir.rglob("pack-epochs.csv")
    epochs = pd.read_csv(path)
    refilled = trials - epochs["trained"].iloc[0]
    return {"refill_ms_per_trial": 1000 * epochs["refill_s"].sum() / max(refilled, 1),
            "results_ms_per_trial": 1000 * epochs["results_s"].sum() / max(epochs["tested"].sum(), 1)}


def expert_matmul_floor(precision: str, steps: int, device: str, repeats: int = 20) -> float:
    """Seconds per trial-epoch of the expert layer's three matmuls alone (forward, the two gradients) at MovieLens'
    shape ([512, 256] x [256, 16 x 256]) in ``precision``: no trial trains faster on this device's matmul kernel."""
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    x, w, g = (torch.randn(*shape, device=device).to(dtype) for shape in ((512, 256), (256, 4096), (512, 4096)))

    def step() -> None:
        x @ w, g @ w.T, x.T @ g

    step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gates", default="comet")
    parser.add_argument("--packs", default="", help="pack sizes P to time (with --ops: to count, default 1,16)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    parser.add_argument("--graphs", default="on",
                        help="on, off or on,off (CUDA graphs of the training step and the validation batches)")
    parser.add_argument("--adam", default="fused",
                        help="fused, elementwise or fused,elementwise (PackedAdam's kernels)")
    parser.add_argument("--ops", action="store_true", help="operation counts per phase, instead of timings")
    parser.add_argument("--setup", type=int, default=0, help="per-trial set-up time over N trials")
    parser.add_argument("--test-pass", default="", help="K[,K...]: a test pass of K trials that ended, each K")
    parser.add_argument("--study", default=None, help="NxE: a whole N-trial study of E epochs, packed and not")
    parser.add_argument("--study-pack", default="auto", help="--pack of the packed study")
    parser.add_argument("--floor", action="store_true", help="the expert matmuls' time per trial-epoch")
    parser.add_argument("--roofline", action="store_true",
                        help="per phase and precision: FLOPs, bytes, launches and the H100 time they project")
    parser.add_argument("--profile", default="",
                        help="P[,P...]: where a pack's training step spends its time (the kernels on a GPU), per P")
    parser.add_argument("--profile-steps", type=int, default=3, help="--profile: warm-up steps, then steps timed "
                        "without and with the profiler, as many each")
    parser.add_argument("--adam-repeats", type=int, default=20, help="--profile: each Adam kernel's median of N")
    parser.add_argument("--matmul-precision", default="highest", choices=["highest", "high"],
                        help="--packs: float32 matmuls in float32 or TF32 (--model.matmul_precision)")
    parser.add_argument("--limit-batches", type=int, default=None,
                        help="--packs: batches per epoch; --test-pass: test batches (default all)")
    parser.add_argument("--profile-epoch", action="store_true",
                        help="--packs: a sixth epoch under cProfile, the host's time by function")
    parser.add_argument("--trial-args", default="",
                        help="--packs, --ops, --roofline, --profile, --study, --test-pass: `fit` options of every "
                        "trial, space-separated (--trial-args='--data.batch_size=8 --model.n_experts=4')")
    parser.add_argument("--data", default=DATA, help="--roofline: the dataset (the other modes time MovieLens-100K)")
    parser.add_argument("--out", type=Path, default=OUT, help="folder of packs.md and packs.json")
    args = parser.parse_args()
    if args.data != DATA and not args.roofline:
        parser.error("--data is for --roofline")
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"CPU {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads")
    data_name = args.data if args.roofline else "MovieLens-100K, batch 512, 16 experts"
    header = (f"{data_name}; {where}, torch {torch.__version__}; {args.precision}, "
              f"matmul precision {args.matmul_precision}")
    print(header, flush=True)
    rows, tables = [], [header, ""]
    gates = args.gates.split(",")
    if args.packs and not (args.ops or args.roofline):
        lines = [("| gate | P | graphs | Adam | epoch (s) | trial-epochs / hour | per trial vs P = 1 "
                  "| memory / trial (MiB) |"),
                 "|---|---|---|---|---|---|---|---|"]
        print(*lines, sep="\n", flush=True)
        profiles: list[tuple[str, Path]] = []
        for gate in gates:
            base = None
            for graphs, adam in itertools.product(args.graphs.split(","), args.adam.split(",")):
                for pack in (int(p) for p in args.packs.split(",")):
                    with matmul_precision(args.matmul_precision):  # as tune's packs train
                        profile = (args.out / f"epoch-profile-{gate}-P{pack}-{graphs}-{adam}.prof"
                                   if args.profile_epoch else None)
                        if profile is not None:
                            profile.parent.mkdir(parents=True, exist_ok=True)
                        seconds, phases, counts = pack_epoch_seconds(
                            gate, pack, args.device, args.precision, graphs == "on", adam == "fused",
                            args.limit_batches, tuple(args.trial_args.split()), profile)
                    rate = pack * 3600 / seconds
                    base = base or rate / pack if pack == 1 else base
                    memory = ""
                    if args.device == "cuda":
                        from mtmoe.pack.memory import memory_per_trial

                        trials = factory(gate, plan(gate, 1, 3)[0], "cuda", args.precision)
                        data = trials.run.datamodule
                        data.setup("fit")
                        per_trial = memory_per_trial(trials.run.model.net, data, torch.device("cuda"),
                                                     args.precision, adam == "fused")
                        memory = f"{per_trial / 2**20:.0f}"
                    rows.append({"gate": gate, "P": pack, "graphs": graphs, "adam": adam, "epoch_s": seconds,
                                 "per_hour": rate, "phases_s": phases, **counts})
                    if profile is not None:
                        profiles.append((f"gate={gate} P={pack} graphs={graphs} adam={adam}", profile))
                    lines.append(f"| {gate} | {pack} | {graphs} | {adam} | {seconds:.2f} | {rate:,.0f} | "
                                 f"{'' if base is None else f'{rate / base:.2f}'} | {memory} |")
                    print(lines[-1], flush=True)
        phase_lines = ["", *(f"phases gate={r['gate']} P={r['P']} graphs={r['graphs']} adam={r['adam']} "
                             + " ".join(f"{name}_s={r['phases_s'][name]:.3f}" for name in EPOCH_PHASES)
                             + f" train_steps={r['train_steps']} val_batches={r['val_batches']}"
                             + f" val_eager={r['val_eager']:.3f}"
                             for r in rows)]
        for name, profile in profiles:
            phase_lines += ["", f"epoch-profile {name}: the sixth epoch's host time by function ({profile.name}, "
                                "every function)", *epoch_profile_lines(profile, 40)]
        print(*phase_lines, sep="\n", flush=True)
        tables += lines + phase_lines
    if args.ops:
        for gate in gates:
            for pack in (int(p) for p in (args.packs or "1,16").split(",")):
                for phase, counted in operations(gate, pack, tuple(args.trial_args.split())).items():
                    line = f"ops gate={gate} P={pack} phase={phase} ops={counted.ops} host_reads={counted.host_reads}"
                    rows.append({"gate": gate, "P": pack, "phase": phase, "ops": counted.ops,
                                 "host_reads": counted.host_reads})
                    tables.append(line)
                    print(line, flush=True)
    if args.roofline:
        from mtmoe.pack.roofline import projected_ms

        breakdown = []
        for gate in gates:
            for pack in (int(p) for p in (args.packs or "1,256").split(",")):
                for bf16 in (False, True):
                    epoch_ms: dict[str, float] = {}
                    for phase, (cost, floor, batches) in roofline(gate, pack, bf16, tuple(args.trial_args.split()),
                                                                  args.data).items():
                        for precision in (("bf16",) if bf16 else ("fp32", "tf32")):
                            projected = projected_ms(cost.flops, cost.bytes, precision)
                            epoch_ms[precision] = epoch_ms.get(precision, 0.0) + projected * batches
                            bottom = projected_ms(cost.flops, floor, precision)
                            line = (f"roofline gate={gate} P={pack} phase={phase} precision={precision} "
                                    f"flops={cost.flops} bytes={cost.bytes} launches={cost.launches} "
                                    f"projected_ms={projected:.3f} floor_ms={bottom:.3f}")
                            rows.append({"gate": gate, "P": pack, "phase": phase, "precision": precision,
                                         "flops": cost.flops, "bytes": cost.bytes, "floor_bytes": floor,
                                         "launches": cost.launches, "projected_ms": projected, "floor_ms": bottom,
                                         "by_kernel": cost.by_kernel})
                            tables.append(line)
                            print(line, flush=True)
                        if phase == "train":
                            top = sorted(cost.by_kernel.items(), key=lambda item: -item[1])[:10]
                            breakdown.append(f"bytes by kernel, gate={gate} P={pack} phase=train "
                                             f"{'bf16' if bf16 else 'fp32/tf32'}: floor {floor / 1e9:.3f} GB, "
                                             + ", ".join(f"{name} {value / 1e9:.3f} GB" for name, value in top))
                    for precision, milliseconds in epoch_ms.items():
                        line = (f"trial-epoch gate={gate} P={pack} data={args.data} precision={precision} "
                                f"projected_ms={milliseconds / pack:.3f}")
                        rows.append({"gate": gate, "P": pack, "data": args.data, "precision": precision,
                                     "trial_epoch_projected_ms": milliseconds / pack})
                        tables.append(line)
                        print(line, flush=True)
        tables += ["", *breakdown]
        print(*breakdown, sep="\n", flush=True)
    if args.test_pass:
        sizes = [int(k) for k in args.test_pass.split(",")]
        batches, passes = test_pass_milliseconds(gates[0], sizes, args.device, tuple(args.trial_args.split()),
                                                 args.limit_batches)
        for k, milliseconds in passes.items():
            line = f"test-pass gate={gates[0]} K={k} device={args.device} batches={batches} ms={milliseconds:.1f}"
            rows.append({"test_pass_K": k, "device": args.device, "batches": batches, "ms": milliseconds})
            tables.append(line)
            print(line, flush=True)
    if args.setup:
        milliseconds = setup_milliseconds(gates[0], args.setup)
        rows.append({"setup_ms": milliseconds, "trials": args.setup})
        tables += ["", f"Per-trial set-up (claim from SQLite, build, load into a slot), {gates[0]}: "
                   f"{milliseconds:.1f} ms (mean of {args.setup})"]
        print(tables[-1], flush=True)
    if args.study:

        trials, epochs = (int(x) for x in args.study.split("x"))
        scratch = Path(tempfile.mkdtemp())
        trial_args = tuple(args.trial_args.split())
        packed, packed_values = study(gates[0], trials, epochs, args.study_pack, args.device, scratch, trial_args)
        host = trial_host_milliseconds(scratch / f"runs-{args.study_pack}", trials)
        alone, alone_values = study(gates[0], trials, epochs, "1", args.device, scratch, trial_args)
        ids = sorted(set(packed_values) & set(alone_values))
        worst = max(abs(packed_values[i] - alone_values[i]) / abs(alone_values[i]) for i in ids)
        rows.append({"study": args.study, "packed_s": packed, "unpacked_s": alone,
                     "objectives": {"packed": packed_values, "unpacked": alone_values}, "packed_host": host})
        tables += ["", f"{gates[0]}, {trials} trials x {epochs} epochs (`tune`, whole command): --pack "
                   f"{args.study_pack} {packed:.0f} s, --pack 1 {alone:.0f} s, {alone / packed:.2f}x; objectives of the "
                   f"{len(ids)} configurations: largest relative difference {worst:.1e}",
                   f"trial-host pack={args.study_pack} " + " ".join(f"{k}={v:.2f}" for k, v in host.items())]
        print(*tables[-2:], sep="\n", flush=True)
    for pack in [int(p) for p in args.profile.split(",") if p]:
        bf16 = args.precision == "bf16-mixed"
        with matmul_precision(args.matmul_precision):
            result, table = profile_step(gates[0], pack, args.device, bf16, tuple(args.trial_args.split()),
                                         args.profile_steps, args.adam_repeats)
        precision = "bf16" if bf16 else {"highest": "fp32", "high": "tf32"}[args.matmul_precision]
        line = (f"profile gate={gates[0]} P={pack} device={args.device} precision={precision} "
                + " ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
                           for key, value in result.items()))
        rows.append({"profile_P": pack, "device": args.device, "precision": precision, **result})
        tables += ["", line, "", table]
        print(*tables[-3:], sep="\n", flush=True)
    if args.floor:
        floors = {precision: expert_matmul_floor(precision, 308, args.device) for precision in ("32", "bf16-mixed")}
        rows.append({"floor_s": floors})
        tables += ["", f"Floor: the expert layer's three matmuls alone take {floors['32']:.3f} s per trial-epoch in "
                   f"fp32 and {floors['bf16-mixed']:.3f} s in bf16 (308 training steps)"]
        print(tables[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic("\n".join(tables) + "\n", args.out / "packs.md")
    write_atomic(json.dumps({"where": where, "rows": rows}, indent=2) + "\n", args.out / "packs.json")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="bench-packs-") as scratch:
        tempfile.tempdir = scratch  # every scratch folder of the run (trials' log folders, storages) goes, and goes
        main()  # away, with it
