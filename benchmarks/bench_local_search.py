"""Overhead of permutation local search per training step, inside the learning window, on MovieLens-100K.

    MTMOE_DATA=../shared/data python benchmarks/bench_local_search.py [--gates topk,comet,hash] [--repeats 40] [--device cuda]

For each gate, a base model and its "+" model (same initialisation) train on the same batches; their steps
(forward, loss, backward, Adam) are timed interleaved, so both see the same machine load, at three positions of
the window: its start (R = 20 Sinkhorn iterations), middle (R = 85) and end (R = 150). Reported: median step times
and the overhead ``(plus - base) / base``. The window-average overhead is the mean over the three positions (R
grows linearly over the window). After the window a "+" step uses a cached matrix (no Sinkhorn, no assignment).
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gates", default="hash,topk,comet")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()

    import lightning.pytorch as pl

    from mtmoe.data import MovieLens100KDataModule
    from mtmoe.gates import gate_class
    from mtmoe.lit.module import MultiTaskMoE, task_loss

    data = MovieLens100KDataModule(batch_size=512)
    data.setup()
    device = torch.device(args.device)
    batches = [{k: v.to(device) for k, v in batch.items()} for batch in data.train_dataloader()]
    window = 1000
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU {torch.get_num_threads()} threads"
    print(f"MovieLens-100K, batch 512, {where}, torch {torch.__version__}; "
          f"median of {args.repeats} interleaved steps per cell\n")
    print("| gate | window position (R) | base step (ms) | + step (ms) | overhead |")
    print("|---|---|---|---|---|")
    for gate in args.gates.split(","):
        models = {}
        for plus in (False, True):
            pl.seed_everything(0, verbose=False)
            model = MultiTaskMoE(gate=partial(gate_class(gate)), info=data.info, perm_epochs=1 if plus else None)
            model.to(device).train()
            if plus:
                model.net.local_search.set_window(window)
            models[plus] = (model, model.configure_optimizers())

        def step(plus: bool, batch: dict) -> float:
            model, optimizer = models[plus]
            start = time.perf_counter()
            out = model.net(batch)
            loss = sum(
                w * task_loss(t, p, batch)[0] for w, t, p in zip(model.weights, model.info.tasks, out.predictions)
            ) + out.aux_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        overheads = []
        for position, at_step in (("start", 1), ("middle", window // 2), ("end", window - 2)):
            models[True][0].net.local_search.step.fill_(at_step - 1)
            times = {False: [], True: []}
            for i in range(args.repeats + 5):
                batch = batches[i % len(batches)]
                for plus in (False, True) if i % 2 == 0 else (True, False):
                    elapsed = step(plus, batch)
                    if i >= 5:
                        times[plus].append(elapsed)
                models[True][0].net.local_search.step.fill_(at_step - 1)  # stay at this window position
            base, plus = statistics.median(times[False]), statistics.median(times[True])
            overheads.append((plus - base) / base)
            r = 20 + 130 * at_step // window
            print(f"| {gate} | {position} ({r}) | {1e3 * base:.1f} | {1e3 * plus:.1f} | {100 * overheads[-1]:+.1f}% |")
        print(f"| {gate} | window average | | | {100 * sum(overheads) / len(overheads):+.1f}% |")


if __name__ == "__main__":
    main()
