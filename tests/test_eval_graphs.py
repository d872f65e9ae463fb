"""The evaluation batches' CUDA graphs (:meth:`mtmoe.pack.engine.PackEngine.eval_step`). A replayed graph runs the
batch's kernels and no Python, so an evaluation batch may change no Python state that a later batch or the pass's
results read, but the metrics' ``offset``, which the engine sets itself.

On the CPU, :class:`ReplayStandIn` takes the capture's place: each batch after its first call of a key runs again with
every Python attribute of the engine and its metrics put back as it was before the call (what a replay leaves
them); the passes' results must be the eager engine's, bit for bit. On a GPU (skipped without one): the graphs'
results are the eager passes', and a replayed pass never synchronises."""
from __future__ import annotations

import pytest
import torch

from mtmoe.pack.engine import PackEngine

from replay import ReplayStandIn
from test_engine import batches, engine_of, trials

PASSES = 6  # three eager calls of each batch, its capture, two replays


def validation() -> list[dict[str, torch.Tensor]]:
    """A validation split's batches, the last one shorter (its own key)."""
    data = batches(99, 3)
    data[-1] = {key: tensor[:17] for key, tensor in data[-1].items()}
    return data


def passes(name: str, engine: PackEngine, device: str) -> list:
    """Every pass's results: a training step before each, an untracked pass (the sanity check) beside the first
    tracked one, and slot 1 refilled before the fourth pass (its recorded selections forgotten)."""
    train = [batches(p, PASSES) for p in range(engine.capacity)]
    val = [{key: tensor.to(device) for key, tensor in batch.items()} for batch in validation()]
    results = []
    for epoch in range(PASSES):
        if epoch == 3:
            engine.slots[1] = None
            engine.load(1, trials(name, 0.5, engine.capacity + 1)[-1])
        engine.train_step({key: torch.stack([d[epoch][key] for d in train]).to(device) for key in train[0][epoch]})
        for tracking in (False, True) if epoch == 0 else (True,):
            engine.eval_metrics.reset()
            engine.eval_metrics.tracking = tracking
            engine.prepare_evaluation()
            for batch in val:
                engine.eval_step(batch)
            results.append(engine.eval_metrics.results())
    return results


@pytest.mark.parametrize("name", ["comet", "topk", "comet+", "softmax"])
def test_a_replayed_evaluation_batch_needs_no_python_state(name: str) -> None:
    """A binary task's AUROC (its probabilities kept across the pass's batches), ``selection_changed`` (each sample's
    selection kept across passes) and every other result of passes replayed as a graph would replay them are the eager
    passes'."""
    eager = passes(name, engine_of(trials(name, 0.5, 3)), "cpu")
    engine = engine_of(trials(name, 0.5, 3))
    engine.captured_eval = ReplayStandIn(engine._eval_step, [engine, engine.eval_metrics,
                                                             *engine.template.modules()])
    replayed = passes(name, engine, "cpu")
    assert all("watch/auroc" in trial for trial in eager[-1])
    assert all("watch/selection_changed" in trial for trial in eager[2])  # compared with the first tracked pass
    changed = [trial.get("watch/selection_changed", 0) for results in eager for trial in results]
    if name == "softmax":  # its top k moves within these steps; COMET's trees keep their leaves
        assert max(changed) > 0
    assert repr(replayed) == repr(eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["comet", "topk", "comet+"])
def test_cuda_evaluation_graphs_compute_the_eager_passes_without_synchronising(name: str) -> None:
    """The same passes with the evaluation graphs and without (``cuda_graphs=False``): the same results; then a pass
    of replays reads nothing on the host."""
    from test_engine_cuda import cuda_engine, unsynchronised

    results = {}
    for graphs in (True, False):
        engine = cuda_engine(name, graphs)
        results[graphs] = passes(name, engine, "cuda")
    assert repr(results[True]) == repr(results[False])
    assert engine.captured_eval is None
    engine = cuda_engine(name, graphs=True)
    passes(name, engine, "cuda")
    assert engine.captured_eval.graphs  # every batch captured by now
    val = [{key: tensor.cuda() for key, tensor in batch.items()} for batch in validation()]
    engine.eval_metrics.reset()
    unsynchronised(lambda: [engine.eval_step(batch) for batch in val])
