"""The schedule interface (:mod:`mtmoe.schedules`): a new per-trial schedule is one class, which ``fit`` and a
pack (``tune --pack``) both drive through the same hooks, and each trial of a pack computes what it computes alone."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from mtmoe.data import MovieLens100KDataModule
from mtmoe.gates import gate_class
from mtmoe.gates.base import GateOutput, RoutingInput
from mtmoe.gates.softmax import SoftmaxGate
from mtmoe.lit.module import MultiTaskMoE, PackModule
from mtmoe.pack.settings import ModelSettings, build_trial
from mtmoe.pack.engine import PackEngine
from mtmoe.schedules import Schedule, schedules

EPOCHS, BATCHES, LR = 2, 5, 1e-2
#: (initial temperature, decay per step, torch seed) of each trial: the first two settings are buffers, so trials
#: with different values share a pack
CONFIGS = [(1.0, 0.9, 1), (2.0, 0.8, 2), (0.5, 0.95, 3)]


class AnnealedSoftmaxGate(SoftmaxGate, Schedule):
    """Test-only: ``softmax(logits / temperature)``, the temperature multiplied by ``decay`` after every training step
    (:meth:`on_step`), the decay itself raised to ``decay ** 0.5`` at every epoch's end (:meth:`on_epoch_end`), and
    the learning rate warmed up linearly over the first ``warmup`` epochs (:meth:`plan`, :meth:`lr_scale`; each of
    the T task gates scales it, so by ``(s / w) ** T``)."""

    def __init__(self, dims, temperature: float = 1.0, decay: float = 0.9, warmup: int = 1) -> None:
        super().__init__(dims)
        self.warmup = warmup
        self.register_buffer("temperature", torch.tensor(temperature))
        self.register_buffer("decay", torch.tensor(decay))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("warmup_steps", torch.ones((), dtype=torch.long))

    def forward(self, routing: RoutingInput) -> GateOutput:
        return GateOutput((self.logits(routing.x) / self.temperature).softmax(dim=-1), self.zero(routing.x))

    def plan(self, steps_per_epoch: int, total_steps: int | None) -> None:
        self.warmup_steps.fill_(max(1, self.warmup * steps_per_epoch))

    def lr_scale(self, state: dict[str, Tensor]) -> Tensor:
        return ((state["steps"] + 1).double() / state["warmup_steps"]).clamp(max=1.0)

    def on_step(self, state: dict[str, Tensor]) -> None:
        state["temperature"].mul_(state["decay"])
        state["steps"].add_(1)

    def on_epoch_end(self, state: dict[str, Tensor]) -> None:
        state["decay"].sqrt_()


def expected_temperature(temperature: float, decay: float) -> Tensor:
    """The anneal in plain float32 operations, outside the engine."""
    t, d = torch.tensor(temperature), torch.tensor(decay)
    for _ in range(EPOCHS):
        for _ in range(BATCHES):
            t = t * d
        d = d.sqrt()
    return t


def gate(temperature: float, decay: float):
    return partial(AnnealedSoftmaxGate, temperature=temperature, decay=decay)


def data_module(root: Path) -> MovieLens100KDataModule:
    data = MovieLens100KDataModule(root=str(root), batch_size=64, seed=0)
    data.setup("fit")
    return data


def trainer() -> pl.Trainer:
    return pl.Trainer(max_epochs=EPOCHS, limit_train_batches=BATCHES, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu")


def test_a_schedule_is_found_by_walking_the_net(tiny_root: Path) -> None:
    model = MultiTaskMoE.build(data_module(tiny_root).info, ModelSettings(gate=gate(1.0, 0.9)))
    found = schedules(model.net)
    assert [name for name, _ in found] == [f"gates.{t}" for t in range(len(model.net.gates))]
    assert all(isinstance(s, AnnealedSoftmaxGate) for _, s in found)


def test_a_new_schedule_is_one_class_that_fit_and_a_pack_both_drive(tiny_root: Path) -> None:
    """Each trial ``fit`` alone (Lightning, a pack of one) and the three in one pack of 3 (``PackModule``, as ``tune
    --pack 3``): the same training losses per epoch to float32 rounding, the same weights, and the same annealed
    temperature, which is the plain float32 anneal's exactly (every hook ran once per step and epoch)."""
    data = data_module(tiny_root)
    alone = []
    for temperature, decay, seed in CONFIGS:
        torch.manual_seed(seed)
        model = MultiTaskMoE.build(data.info, ModelSettings(gate=gate(temperature, decay), lr=LR, cuda_graphs=False))
        trainer().fit(model, datamodule=data)
        alone.append(model)
        for g in model.net.gates:
            assert int(g.warmup_steps) == BATCHES and int(g.steps) == EPOCHS * BATCHES
            assert torch.equal(g.temperature, expected_temperature(temperature, decay))

    built = []
    for key, (temperature, decay, seed) in enumerate(CONFIGS):
        torch.manual_seed(seed)
        built.append(build_trial(data.info, key, ModelSettings(gate=gate(temperature, decay), lr=LR), data_seed=0,
                                 max_epochs=EPOCHS))
    source, results = iter(list(built)), {}
    module = PackModule(data.info, data.splits, data.batch_size, data.eval_batch_size, len(CONFIGS),
                        lambda: next(source, None), lambda result: results.setdefault(result.key, result),
                        cuda_graphs=False)
    trainer().fit(module)
    assert sorted(results) == [0, 1, 2]
    for key, model in enumerate(alone):
        packed = [record["train"]["loss"] for record in results[key].results["history"]]
        single = [record["train"]["loss"] for record in model.trial.history]
        assert packed == pytest.approx(single, rel=0, abs=1e-5)
        mine = dict(built[key].net.named_parameters())
        for name, value in model.net.named_parameters():
            assert torch.allclose(mine[name], value, rtol=0, atol=1e-4), name
        for t, g in enumerate(built[key].net.gates):
            assert torch.equal(g.temperature, model.net.gates[t].temperature)
            assert torch.equal(g.decay, model.net.gates[t].decay)


@pytest.mark.parametrize("warmup", [1, 2])
def test_the_learning_rate_scale_reaches_adam(tiny_root: Path, warmup: int) -> None:
    """Adam's first update of a trial is ``lr * m / (sqrt(v) + eps)`` with ``m / sqrt(v) = sign(g)`` (eps 1e-12):
    its largest step is the scaled rate, ``lr * (1 / (warmup * steps per epoch)) ** T`` for each trial of a pack."""
    info = data_module(tiny_root).info
    pack = []
    for key, (temperature, decay, seed) in enumerate(CONFIGS):
        torch.manual_seed(seed)
        pack.append(build_trial(info, key, ModelSettings(gate=partial(gate(temperature, decay), warmup=warmup), lr=LR,
                                                      adam_eps=1e-12)))
    engine = PackEngine(pack[0].net, info.tasks, len(pack), "cpu", cuda_graphs=False)
    engine.set_steps_per_epoch(BATCHES)
    for slot, trial in enumerate(pack):
        engine.load(slot, trial)
    before = {name: leaf.detach().clone() for name, leaf in engine.stack.params.items()}
    data = data_module(tiny_root).splits["train"]
    engine.train_step({key: tensor[:64].expand(len(pack), *tensor[:64].shape) for key, tensor in data.items()})
    moved = torch.stack([(engine.stack.params[name].detach() - value).abs().flatten(1).amax(1)
                         for name, value in before.items()]).amax(0)
    scale = (1 / (warmup * BATCHES)) ** len(info.tasks)
    # the float32 difference of parameters of magnitude ~0.1-1 is exact to ~1e-4 of a step this small
    assert moved.tolist() == pytest.approx([LR * scale] * len(pack), rel=1e-3)


def test_a_fit_resumed_inside_the_window_continues_its_schedules(tiny_root: Path, tmp_path: Path) -> None:
    """A ``topk+`` fit (a window of 2 epochs) checkpointed after epoch 1 and resumed to epoch 3 trains as the fit
    run straight through: the trial's step count comes back with the engine's state, so local search rounds at the
    window's end, not at a step counted from the resume."""
    data = data_module(tiny_root)

    def model() -> MultiTaskMoE:
        torch.manual_seed(0)
        return MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class("topk")), lr=LR, perm_epochs=2,
                                                        cuda_graphs=False))

    def run(epochs: int, net: MultiTaskMoE, ckpt_path: Path | None = None) -> pl.Trainer:
        fitter = pl.Trainer(max_epochs=epochs, limit_train_batches=BATCHES, limit_val_batches=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            accelerator="cpu")
        fitter.fit(net, datamodule=data, ckpt_path=ckpt_path, weights_only=False)  # hparams hold a partial
        return fitter

    straight = model()
    run(3, straight)
    first = model()
    run(1, first).save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = model()
    run(3, resumed, tmp_path / "epoch1.ckpt")
    assert resumed.trial.steps == straight.trial.steps == 3 * BATCHES
    losses = [[record["train"]["loss"] for record in m.trial.history] for m in (straight, resumed)]
    assert losses[1] == pytest.approx(losses[0], rel=0, abs=1e-6)
    assert resumed.net.local_search.frozen
    assert torch.equal(resumed.net.local_search.rounded, straight.net.local_search.rounded)
    assert torch.equal(resumed.net.local_search.log_weights, straight.net.local_search.log_weights)
