"""Overhead of permutation local search per training step, inside the learning window and after it, on MovieLens-100K.

    MTMOE_DATA=../shared/data python benchmarks/bench_local_search.py [--gates topk,comet,hash] [--device cuda]

For each gate, a base model and its "+" model (same initialisation) train on the same batches; their steps
(forward, loss, backward, Adam) are timed in adjacent pairs, alternating which goes first, so both see the same
machine load. Positions: the window's start (R = 20 Sinkhorn iterations), middle (R = 85), end (R = 150), and
after the window (the frozen permutation). Reported per cell: median step times and the overhead, the median over
pairs of ``plus / base - 1`` (robust to load changes between pairs on a shared machine). The window average is the
mean over the three window positions (R grows linearly over the window).

Also reported: the compute operations one step dispatches (ATen calls counted by :class:`ComputeOperations`, views
and host-scalar reads left out), the cost that matters where a step is launch-bound (a kernel launch each on a GPU).
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ComputeOperations(TorchDispatchMode):
    """Counts the ATen operations that compute (a device kernel each) inside the ``with`` block: views and reads of
    host scalars are left out."""

    SKIPPED = {"_local_scalar_dense", "detach", "view", "_unsafe_view", "expand", "select", "t", "transpose", "alias"}

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.SKIPPED:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gates", default="hash,topk,comet")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()

    import lightning.pytorch as pl

    from mtmoe.data import MovieLens100KDataModule
    from mtmoe.gates import gate_class
    from mtmoe.lit.module import MultiTaskMoE
    from mtmoe.pack.settings import ModelSettings
    from mtmoe.losses import task_loss

    data = MovieLens100KDataModule(batch_size=512)
    data.setup()
    device = torch.device(args.device)
    batches = [{k: v.to(device) for k, v in batch.items()} for batch in data.train_dataloader()]
    window = 1000
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU {torch.get_num_threads()} threads"
    print(f"MovieLens-100K, batch 512, {where}, torch {torch.__version__}; {args.repeats} step pairs per cell\n")
    print("| gate | position (R) | base step (ms) | + step (ms) | overhead | base ops | + ops |")
    print("|---|---|---|---|---|---|---|")
    for gate in args.gates.split(","):
        models = {}
        for plus in (False, True):
            pl.seed_everything(0, verbose=False)
            model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class(gate)),
                                                                perm_epochs=1 if plus else None))
            model.to(device).train()
            if plus:
                model.net.local_search.set_window(window)
            models[plus] = (model, model.configure_optimizers())

        def step(plus: bool, batch: dict) -> float:
            model, optimizer = models[plus]
            start = time.perf_counter()
            out = model.net(batch)
            loss = sum(
                w * task_loss(t, p, batch)[0] for w, t, p in zip(model.trial.task_weights, model.info.tasks, out.predictions)
            ) + out.aux_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        def operations(plus: bool, batch: dict) -> int:
            with ComputeOperations() as counter:
                step(plus, batch)
            return len(counter.names)

        search = models[True][0].net.local_search
        window_overheads = []
        for position, at_step in (("start", 1), ("middle", window // 2), ("end", window - 2), ("after", window + 1)):
            search.step.fill_(at_step - 1)
            for _ in range(3):  # warm up (and, for "after", pass the transition)
                for plus in (False, True):
                    step(plus, batches[0])
                search.step.fill_(at_step - 1)
            times = {False: [], True: []}
            for i in range(args.repeats):
                batch = batches[i % len(batches)]
                for plus in (False, True) if i % 2 == 0 else (True, False):
                    times[plus].append(step(plus, batch))
                search.step.fill_(at_step - 1)  # stay at this window position
            ops = {plus: operations(plus, batches[0]) for plus in (False, True)}
            search.step.fill_(at_step - 1)
            assert search.frozen == (position == "after")
            overhead = statistics.median(p / b - 1 for b, p in zip(times[False], times[True]))
            if position != "after":
                window_overheads.append(overhead)
            base, plus = statistics.median(times[False]), statistics.median(times[True])
            r = "frozen" if position == "after" else 20 + 130 * at_step // window
            print(f"| {gate} | {position} ({r}) | {1e3 * base:.1f} | {1e3 * plus:.1f} | {100 * overhead:+.1f}% "
                  f"| {ops[False]} | {ops[True]} |")
        print(f"| {gate} | window average | | | {100 * sum(window_overheads) / len(window_overheads):+.1f}% | | |")


if __name__ == "__main__":
    main()
