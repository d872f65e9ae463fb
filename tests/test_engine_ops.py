"""Each operation once per pack (issue 21): for every registered gate and "+" variant, a training step of the engine
(inside and after the permutation window for "+") and an evaluation batch dispatch as many ATen operations for a
pack of 16 trials as for a pack of one, and none reads a device value on the host (``mtmoe.pack.operations``; the
same count as ``benchmarks/bench_packs.py --ops``)."""
from __future__ import annotations

import pytest
import torch

from mtmoe.pack.operations import phases

from test_engine import VARIANTS, batches, engine_of, trials


def pack_phases(name: str, capacity: int, fused_sums: bool = False) -> dict:
    pack = trials(name, 0.5, capacity)
    for trial in pack:
        trial.net.experts.fused_sums = fused_sums  # --model.fused_mixing_sums
        if trial.net.local_search is not None:
            trial.net.local_search.epochs = 2  # windows of 4 steps: a step inside, then after it
    engine = engine_of(pack)
    data = [batches(p % 4, 1)[0] for p in range(capacity)]
    batch = {key: torch.stack([d[key] for d in data]) for key in data[0]}
    return phases(engine, batch, batches(0, 1)[0])


@pytest.mark.parametrize("name", VARIANTS)
def test_a_packed_step_dispatches_the_same_operations_for_any_pack_size(name: str) -> None:
    one, sixteen = pack_phases(name, 1), pack_phases(name, 16)
    assert set(one) == set(sixteen) == ({"window", "after", "eval"} if name.endswith("+") else {"train", "eval"})
    for phase in one:
        assert one[phase].ops == sixteen[phase].ops, (phase, one[phase].ops, sixteen[phase].ops)
        assert one[phase].host_reads == sixteen[phase].host_reads == 0, (phase, sixteen[phase].reads)


@pytest.mark.parametrize("name", ["comet", "comet+"])
def test_the_fused_mixing_sums_dispatch_the_same_operations_for_any_pack_size(name: str) -> None:
    """``--model.fused_mixing_sums``: the same counts at P = 1 and 16, and no host read."""
    one, sixteen = pack_phases(name, 1, True), pack_phases(name, 16, True)
    for phase in one:
        assert one[phase].ops == sixteen[phase].ops, (phase, one[phase].ops, sixteen[phase].ops)
        assert one[phase].host_reads == sixteen[phase].host_reads == 0, (phase, sixteen[phase].reads)
