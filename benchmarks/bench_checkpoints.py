"""What a pack checkpoint costs (:mod:`mtmoe.tuning.checkpoints`): the snapshot of a pack's state ``tune`` keeps at
every pack epoch's end (:meth:`mtmoe.pack.engine.PackEngine.snapshot` with ``on_device=True``: a copy into buffers
on the pack's device, reused from one epoch to the next; the trials' states are made of it only for a write),
beside a fresh host copy of it (``checkpoint()``, what ``tune`` kept before), and the file written on a stop
(:meth:`~mtmoe.tuning.checkpoints.PackCheckpoints.write`), for the paper's model of a dataset and gate on this CPU,
every trial with best weights.

    MTMOE_DATA=../shared/data python benchmarks/bench_checkpoints.py --packs 4,16
    MTMOE_DATA=../shared/data python benchmarks/bench_checkpoints.py --packs 256 \
        --trial-args="--model.n_experts=4 --model.embedding_dim=4 --model.expert_units=8 --model.tower_units=8"
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

from mtmoe.pack.engine import PackEngine, Trial
from mtmoe.run import build_run
from mtmoe.tuning.checkpoints import PackCheckpoints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="movielens-100k")
    parser.add_argument("--gate", default="comet")
    parser.add_argument("--packs", default="4,16")
    parser.add_argument("--trial-args", default="", help="`fit` options of every trial, space-separated (tiny "
                        "trials: the host's share of the snapshot, as on a GPU)")
    args = parser.parse_args()
    run = build_run(["--gate", args.gate, "--data", args.data, *args.trial_args.split()])
    net, tasks = run.model.net, run.datamodule.info.tasks
    print(f"{args.data} {args.gate}: {sum(p.numel() for p in net.parameters()):,} parameters per trial")
    for capacity in map(int, args.packs.split(",")):
        engine = PackEngine(net, tasks, capacity, "cpu")
        for slot in range(capacity):
            trial = Trial(slot, copy.deepcopy(net), (1.0,) * len(tasks), 1e-4, 1e-7, 0, None, 25, epochs_run=1,
                          best_epoch=0)
            engine.load(slot, trial)
        engine.best = {name: tensor.clone() for name, tensor in engine.stack.tensors().items()}
        cpu, wall = time.process_time(), time.perf_counter()
        engine.checkpoint()
        copy_cpu, copy_wall = time.process_time() - cpu, time.perf_counter() - wall
        engine.snapshot(on_device=True)  # the first epoch's allocates the buffers
        cpu, wall = time.process_time(), time.perf_counter()
        states = engine.snapshot(on_device=True)
        kept_cpu, kept_wall = time.process_time() - cpu, time.perf_counter() - wall
        wall = time.perf_counter()
        states()  # what a write makes of it (before, every epoch end made it)
        states_wall = time.perf_counter() - wall
        checkpoints = PackCheckpoints(Path(tempfile.mkdtemp()), {})
        checkpoints.keep(lambda: [(key, "structure", "hash", state) for key, state in states()])
        cpu, wall = time.process_time(), time.perf_counter()
        checkpoints.write()
        write_cpu, write_wall = time.process_time() - cpu, time.perf_counter() - wall
        size = checkpoints.path.stat().st_size
        checkpoints.clear()
        checkpoints.folder.rmdir()
        print(f"P={capacity}: epoch-end snapshot {kept_cpu:.3f} s CPU ({kept_wall:.3f} s wall; the trials' states "
              f"made of it {states_wall:.3f} s wall; a fresh host copy "
              f"{copy_cpu:.2f} s CPU, {copy_wall:.2f} s wall); file {size / 2**20:.0f} "
              f"MiB ({size / capacity / 2**20:.1f} MiB a trial) written in {write_cpu:.2f} s CPU ({write_wall:.2f} s "
              "wall)")


if __name__ == "__main__":
    main()
