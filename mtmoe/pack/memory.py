"""The device memory one more trial adds to a pack, measured (``tune --pack auto`` and its checks)."""
from __future__ import annotations

import copy

import torch

from mtmoe.mmoe import MMoE
from mtmoe.pack.engine import PackEngine, Trial


def memory_per_trial(net: MMoE, datamodule, device: torch.device, precision: str = "32",
                     fused_adam: bool = True, checkpoints: bool = False) -> int:
    """Bytes per trial on a GPU: the difference of the peaks of a training step and an evaluation batch in packs
    of three and of one throwaway copy of ``net`` (each measured after a first pack of one has made the one-time
    allocations: cuBLAS's workspace, compiled kernels), halved, plus its best-weights snapshot and, with
    ``checkpoints``, the state ``tune`` keeps on the device at each epoch end (``PackEngine.snapshot(on_device=
    True)``: its parameters and buffers, best weights and Adam's two moments)."""
    split = datamodule.splits["train"]
    size = datamodule.batch_size

    def peak(capacity: int) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        engine = PackEngine(net, datamodule.info.tasks, capacity, device, cuda_graphs=False, fused_adam=fused_adam)
        for slot in range(capacity):
            engine.load(slot, Trial(None, copy.deepcopy(net), (1.0,) * len(datamodule.info.tasks), 1e-4, 1e-7, 0,
                                    1, 1))
        engine.set_steps_per_epoch(1)
        index = torch.arange(size).expand(capacity, -1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            engine.train_step({key: tensor[index].to(device) for key, tensor in split.items()})
            engine.eval_step({key: tensor[:datamodule.eval_batch_size].to(device)
                              for key, tensor in datamodule.splits["val"].items()})
        torch.cuda.synchronize(device)
        used = torch.cuda.max_memory_allocated(device) - base
        del engine
        return used

    peak(1)
    one = peak(1)
    snapshot = sum(t.numel() * t.element_size() for t in (*net.parameters(), *net.buffers()))
    moments = 2 * 4 * sum(p.numel() for p in net.parameters())  # float32
    return max((peak(3) - one) // 2, 1) + snapshot + (2 * snapshot + moments if checkpoints else 0)
