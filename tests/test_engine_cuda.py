"""The engine on a GPU (skipped without one): a training step (inside and after the permutation window) and an
evaluation batch (replayed from its CUDA graph) never synchronise with the host, for every gate and "+" variant
(``torch.cuda.set_sync_debug_mode("error")``; local search's rounding, between steps, is the one host read, once per
trial when its window ends), and the CUDA graph of the step computes what the eager step computes, trial by trial,
through a shorter last batch, a window's end and a refilled slot."""
from __future__ import annotations

import pytest
import torch

from mtmoe.pack.engine import PackEngine

from test_engine import STEPS_PER_EPOCH, VARIANTS, batches, info, trials

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_engine(name: str, graphs: bool, capacity: int = 3, perm_epochs: int | None = None) -> PackEngine:
    pack = trials(name, 0.5, capacity)
    for trial in pack:
        if perm_epochs is not None and trial.net.local_search is not None:
            trial.net.local_search.epochs = perm_epochs
    engine = PackEngine(pack[0].net, info(0.0).tasks, capacity, "cuda", cuda_graphs=graphs)
    engine.set_steps_per_epoch(STEPS_PER_EPOCH)
    for slot, trial in enumerate(pack):
        engine.load(slot, trial)
    return engine


def pack_batch(step: int, capacity: int, rows: int | None = None) -> dict[str, torch.Tensor]:
    data = [batches(p, step + 1)[step] for p in range(capacity)]
    return {key: torch.stack([d[key][:rows] for d in data]).cuda() for key in data[0]}


def unsynchronised(steps) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", VARIANTS)
def test_a_training_step_and_an_evaluation_never_synchronise(name: str) -> None:
    engine = cuda_engine(name, graphs=True, perm_epochs=5)  # windows of 10 steps
    for step in range(5):  # warm-up and capture, inside the windows
        engine.train_step(pack_batch(step, 3))
    engine.prepare_evaluation()  # rounds the soft permutations (between steps)
    evaluation = {key: tensor[0] for key, tensor in pack_batch(0, 3).items()}
    for _ in range(4):  # a pass of one batch: three eager calls, then its capture
        engine.eval_metrics.reset()
        engine.eval_step(evaluation)
    inputs = [pack_batch(step, 3) for step in range(19)]  # copied to the device before: a copy from the host waits
    unsynchronised(lambda: [engine.train_step(inputs[step]) for step in range(5, 9)])
    engine.prepare_evaluation()  # the rounding, a host read, outside; the flags of the captured pass again
    engine.eval_metrics.reset()
    unsynchronised(lambda: engine.eval_step(evaluation))  # replayed
    for step in range(9, 16):  # the windows end (a rounding between steps), the step without Sinkhorn captured
        engine.train_step(inputs[step])
    unsynchronised(lambda: [engine.train_step(inputs[step]) for step in range(16, 19)])


@pytest.mark.parametrize("name", ["comet", "comet+", "sparsemixer", "competesmoe-v2", "topk+"])
def test_the_cuda_graph_of_a_step_computes_the_eager_step(name: str) -> None:
    results = []
    for graphs in (True, False):
        engine = cuda_engine(name, graphs)
        losses = []
        for step in range(12):
            rows = 17 if step % 4 == 3 else None  # a shorter last batch of an epoch: its own graph
            if step == 8:  # a refill: slot 1 takes a fresh trial
                engine.slots[1] = None
                engine.load(1, trials(name, 0.5, 4)[3])
            engine.train_metrics.reset()
            engine.train_step(pack_batch(step, 3, rows))
            losses.append(engine.train_metrics.loss.clone())
        results.append((torch.stack(losses), engine.stack.flat.clone()))
    (graph_losses, graph_params), (eager_losses, eager_params) = results
    assert torch.allclose(graph_losses, eager_losses, rtol=0, atol=1e-6)
    assert torch.allclose(graph_params, eager_params, rtol=0, atol=1e-6)


def test_the_triton_adam_kernel_computes_the_elementwise_update_bit_for_bit() -> None:
    """On the GPU the one-launch Adam (Triton) rounds each operation as the element-wise torch kernels do (its lerp
    is CUDA's fused multiply-add, its square root and divisions IEEE), and agrees with the CPU kernel to float32
    rounding; the skipped weight stays as it was."""
    from test_engine import adam_states

    triton_state, initial = adam_states("cuda", fused=True)
    elementwise_state, _ = adam_states("cuda", fused=False)
    cpu_state, _ = adam_states("cpu", fused=True)
    assert torch.equal(triton_state, elementwise_state), (triton_state - elementwise_state).abs().max()
    assert torch.allclose(triton_state, cpu_state, rtol=0, atol=1e-7)
    assert torch.equal(triton_state[3 * 4530 + 90:3 * 4530 + 180], initial.flatten())


def test_the_triton_adam_reads_gradients_where_they_lie_bit_for_bit() -> None:
    """The per-block kernel reading each gradient with its own strides (a weight's transposed, a bias's
    contiguous; with copies and bfloat16 gradients too) gives the one-launch kernel's states bitwise."""
    from test_engine import adam_states

    assert torch.equal(adam_states("cuda", fused=True, kept=True)[0], adam_states("cuda", fused=True)[0])
    assert torch.equal(adam_states("cuda", fused=True, copies=True, gradients=True, kept=True)[0],
                       adam_states("cuda", fused=True, rounded=True)[0])


def test_a_capture_survives_a_graph_dying_during_it() -> None:
    """A CUDA graph that becomes cyclic garbage during another capture (as a dead engine's: an engine and its
    ``CapturedStep`` form a cycle) is not destroyed there: with a collection due at nearly every allocation,
    ``CapturedStep`` captures and replays, and the graph is collected after. Destroying a graph while a stream
    captures fails the capture; seen on an H200 (remoe+'s capture, a previous test's engine collected during it)
    before the collector was paused."""
    import gc
    import weakref

    from mtmoe.pack.graphs import EAGER_CALLS, CapturedStep

    class Holder:
        pass

    spare = Holder()
    spare.x = torch.zeros(4, device="cuda")
    spare.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(spare.graph):
        spare.x.add_(1)
    spare.graph.replay()
    spares, dying = [spare], []
    del spare
    out = torch.zeros(64, device="cuda")

    def step(inputs: dict[str, torch.Tensor]) -> None:
        if torch.cuda.is_current_stream_capturing() and spares:
            holder = spares.pop()
            holder.me = holder  # garbage from here on: only a collection frees it
            dying.append(weakref.ref(holder))
            del holder
        for _ in range(50):  # Python allocations inside the capture
            out.copy_(torch.relu(inputs["x"] * 2 + 1))

    captured = CapturedStep(step)
    x = torch.arange(64.0, device="cuda")
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for _ in range(EAGER_CALLS):
            captured("key", {"x": x})
        captured("key", {"x": x - 5})  # the capture, then its replay
        captured("key", {"x": x})  # a replay
        torch.cuda.synchronize()
    finally:
        gc.set_threshold(*threshold)
    assert "key" in captured.graphs and len(dying) == 1
    assert torch.equal(out, torch.relu(x * 2 + 1))
    gc.collect()
    assert dying[0]() is None


def test_a_checkpoint_kept_on_the_device_is_the_host_checkpoint_and_is_written_to_the_host(tmp_path) -> None:
    """``tune`` keeps each epoch end's checkpoint on the GPU (``PackEngine.checkpoint(on_device=True)``: no transfer per
    epoch); it holds what the host checkpoint holds, later steps leave it as it was, and a write moves it to the
    host."""
    from mtmoe.tuning.checkpoints import PackCheckpoints

    def tensors(value, out, prefix=""):
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                tensors(item, out, f"{prefix}/{key}")
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                tensors(item, out, f"{prefix}/{index}")
        return out

    engine = cuda_engine("comet", graphs=True)
    for step in range(5):
        engine.train_step(pack_batch(step, 3))
    engine.end_epoch([{"loss": 1.0}] * 3)
    device, host = engine.checkpoint(on_device=True), engine.checkpoint()
    for step in range(5, 8):  # the pack trains on: the snapshot is a copy
        engine.train_step(pack_batch(step, 3))
    on_device = {k: v for slot, (_, state) in enumerate(device) for k, v in tensors(state, {}, str(slot)).items()}
    on_host = {k: v for slot, (_, state) in enumerate(host) for k, v in tensors(state, {}, str(slot)).items()}
    assert on_device.keys() == on_host.keys() and all(t.is_cuda for t in on_device.values())
    assert all(torch.equal(on_device[k].cpu(), on_host[k]) for k in on_host)
    checkpoints = PackCheckpoints(tmp_path, {"identity": 1})
    checkpoints.keep(lambda: [(slot, "structure", "hash", state) for slot, (_, state) in enumerate(device)])
    checkpoints.write()
    written = torch.load(checkpoints.path, weights_only=True)["trials"]
    saved = {k: v for slot, entry in written.items() for k, v in tensors(entry["state"], {}, str(slot)).items()}
    assert saved.keys() == on_host.keys() and not any(t.is_cuda for t in saved.values())
    assert all(torch.equal(saved[k], on_host[k]) for k in on_host)
