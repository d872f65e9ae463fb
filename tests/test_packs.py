"""Trial packs (``mtmoe.pack``): a packed trial computes what the same configuration computes alone.

* Adam over stacked rows equals ``torch.optim.Adam`` per trial;
* for every registered gate and every "+" variant, each trial of a pack of 3 (own seed, learning rate, task weights,
  E_perm and tunable gate scalars) trained for 25 steps with dropout off has the losses and parameters of the same
  configuration trained alone on the same batches (float32 rounding: the tolerances below);
* with dropout on, each trial draws its own masks;
* a whole packed fit (early stopping, best weights, test, refill of a freed slot, a diverging trial beside others)
  reports what ``fit`` reports for each configuration alone.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch

from torch.func import functional_call, vmap

from mtmoe.dataset_info import DatasetInfo, TaskSpec
from mtmoe.experts import DenseExperts, dropout_mask
from mtmoe.gates import gate_class, list_gates
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.losses import multitask_loss
from mtmoe.pack.adam import PackedAdam
from mtmoe.pack.model import PackedModel
from mtmoe.pack.stack import TrialStack

INFO = DatasetInfo(name="tiny", tasks=(TaskSpec("watch", "binary"), TaskSpec("rating", "regression", masked=True)),
                   n_ids=50, n_users=50, n_items=40, embedding_dim=8, expert_units=16, tower_units=8, n_experts=5,
                   expert_dropout=0.0)
P, B, STEPS, WINDOW = 3, 32, 25, 4  # E_perm of trial p is p + 1 epochs of WINDOW steps: every window ends within
LOSS_TOLERANCE, PARAM_TOLERANCE = 5e-6, 1e-5  # measured worst cases: 1e-6 and 2e-6
VARIANTS = [name + plus for name in list_gates() for plus in ("", "+") if not plus or gate_class(name).permutable]
#: Per-trial values of the float hyperparameters a pack lets each trial have (``Gate.scalar_hyperparameters``).
SCALAR_VALUES = {"gamma": (0.1, 1.0, 10.0), "entropy_reg": (0.5, 5.0, 0.05), "zeta": (1.0, 0.5, 2.0),
                 "competition_prob": (0.3, 0.6, 0.9), "router_loss_coef": (0.05, 0.3, 0.01),
                 "distill_coef": (0.01, 0.03, 0.001), "winner_weight": (0.1, 0.0, 0.3),
                 "diversity_coef": (0.005, 0.01, 0.0), "midpoint_prob": (1.0, 0.5, 1.0), "jitter": (0.1, 0.2, 0.05),
                 "alpha": (0.3, 0.5, 0.7)}


def is_stochastic(name: str) -> bool:
    """Gates that sample in training (SparseMixer): a pack draws their noise from one stream for all trials."""
    return name.rstrip("+") == "sparsemixer"


def build(name: str, p: int, per_task: bool = False) -> MultiTaskMoE:
    """Trial p of the pack: its own seed, learning rate, alpha, gate scalars and E_perm."""
    cls = gate_class(name.rstrip("+"))
    scalars = {key: SCALAR_VALUES[key][p] for key in cls.scalar_hyperparameters}
    extra = {"warmup": 0.0} if "warmup" in cls.__init__.__code__.co_varnames else {}
    torch.manual_seed(100 + p)
    module = MultiTaskMoE(gate=partial(cls, **scalars, **extra), info=INFO, lr=(1e-3, 3e-3, 5e-4)[p],
                          alpha=(0.1, 0.5, 0.9)[p], perm_epochs=p + 1 if name.endswith("+") else None, zeta=1e-3,
                          perm_per_task=per_task)
    if module.net.local_search is not None:
        module.net.local_search.set_window(WINDOW)
    for gate in module.net.gates:
        gate.set_training_steps(STEPS)
    return module


def batches(p: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(p)
    out = []
    for _ in range(STEPS):
        user = torch.randint(0, 50, (B,), generator=g)
        out.append({"user": user, "item": torch.randint(0, 40, (B,), generator=g), "sample_id": user,
                    "watch": (torch.rand(B, generator=g) < 0.5).float(), "rating": torch.rand(B, generator=g) * 5,
                    "rating_mask": torch.rand(B, generator=g) < 0.5})
    return out


def train_alone(module: MultiTaskMoE, data: list[dict]) -> list[float]:
    """The unpacked training step (``MultiTaskMoE``'s loss, ``torch.optim.Adam(fused=True)`` as in ``fit``)."""
    optimizer = module.configure_optimizers()
    module.train()
    losses = []
    for batch in data:
        output = module.net(batch)
        loss, _, _ = multitask_loss(INFO.tasks, module.weights, output.predictions, batch)
        optimizer.zero_grad()
        (loss + output.aux_loss).backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_packed(modules: list[MultiTaskMoE], data: list[list[dict]]) -> torch.Tensor:
    pack = PackedModel(modules[0], len(modules), "cpu")
    adam = PackedAdam(pack.stack)
    for slot, module in enumerate(modules):
        pack.load(slot, module)
        adam.reset(slot, module.lr, module.adam_eps)
    losses = []
    for step in range(STEPS):
        batch = {key: torch.stack([data[p][step][key] for p in range(len(modules))]) for key in data[0][step]}
        loss, _, aux = pack.losses(batch, shared_batch=False, training=True)
        pack.stack.zero_grad()
        (loss + aux).sum().backward()
        adam.step(list(range(len(modules))), pack.unused_parameters())
        losses.append(loss.detach())
    return torch.stack(losses, dim=1)  # [P, STEPS]


@pytest.mark.parametrize("name, per_task", [(name, False) for name in VARIANTS] + [("comet+", True)])
def test_each_trial_of_a_pack_trains_as_it_would_alone(name: str, per_task: bool) -> None:
    if is_stochastic(name):
        pytest.skip("samples in training: covered by the pack-of-one and evaluation tests below")
    alone = [build(name, p, per_task) for p in range(P)]
    expected = [train_alone(module, batches(p)) for p, module in enumerate(alone)]
    packed = [build(name, p, per_task) for p in range(P)]
    losses = train_packed(packed, [batches(p) for p in range(P)])
    assert torch.allclose(losses, torch.tensor(expected), rtol=0, atol=LOSS_TOLERANCE), name
    for p in range(P):
        reference = dict(alone[p].net.named_parameters())
        for key, value in packed[p].net.named_parameters():  # the trial's own module sees the packed values
            assert torch.allclose(value, reference[key], rtol=0, atol=PARAM_TOLERANCE), (name, p, key)
        if name.endswith("+"):  # its window ended and its permutation was rounded as alone
            assert packed[p].net.local_search.frozen
            assert torch.equal(packed[p].net.local_search.rounded, alone[p].net.local_search.rounded)


@pytest.mark.parametrize("name", [v for v in VARIANTS if is_stochastic(v)])
def test_a_pack_of_one_draws_what_the_trial_draws_alone(name: str) -> None:
    """With the same generator state a pack of one samples exactly as the unpacked trial (bitwise)."""
    alone, module, data = build(name, 0), build(name, 0), batches(0)
    torch.manual_seed(7)
    expected = train_alone(alone, data)
    torch.manual_seed(7)
    losses = train_packed([module], [data])
    assert losses[0].tolist() == expected


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_evaluation_equals_each_trial_alone(name: str) -> None:
    modules = [build(name, p) for p in range(P)]
    batch = batches(0)[0]
    expected = []
    for module in modules:
        module.eval()
        with torch.no_grad():
            output = module.net(batch)
            expected.append(multitask_loss(INFO.tasks, module.weights, output.predictions, batch)[0])
    pack = PackedModel(modules[0], P, "cpu")
    for slot, module in enumerate(modules):
        pack.load(slot, module)
    with torch.no_grad():
        loss, _, aux = pack.losses(batch, shared_batch=True, training=False)
    assert torch.allclose(loss, torch.stack(expected), rtol=0, atol=LOSS_TOLERANCE)
    assert not aux.any()  # evaluation losses are pure task losses


def test_dropout_masks_are_drawn_per_trial() -> None:
    """Three identical trials of dropout experts: their masks differ, and each keeps half of the activations."""
    torch.manual_seed(0)
    experts = DenseExperts(8, 64, 5, dropout=0.5).train()
    params = {key: value.detach().expand(P, *value.shape) for key, value in experts.named_parameters()}
    x = torch.randn(256, 8)
    with torch.no_grad():
        out = vmap(lambda params, x: functional_call(experts, params, (x,)), in_dims=(0, None),
                   randomness="different")(params, x)
        active = experts.linear(x).view_as(out[0]) > 0
    kept = out != 0
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[1], kept[2])
    fractions = kept.float().sum(dim=(1, 2, 3)) / active.sum()
    assert torch.allclose(fractions, torch.full((P,), 0.5), atol=0.01)


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_dropout_mask_is_inverted_dropout(p: float) -> None:
    """Each value is 0 or itself / (1 - p), kept with probability 1 - p; the gradient flows through kept values."""
    torch.manual_seed(0)
    h = torch.rand(512, 1024, requires_grad=True)
    out = h * dropout_mask(h, p)
    kept = out != 0
    assert torch.equal(out[kept], h[kept] * (1.0 / (1.0 - p)))
    assert abs(kept.float().mean().item() - (1 - p)) < 0.005
    out.sum().backward()
    assert torch.equal(h.grad, kept.float() * (1.0 / (1.0 - p)))


def test_packed_experts_stay_in_bf16_under_autocast() -> None:
    """A pack's expert layer under bf16 autocast returns bf16, as the unpacked layer does: vmap's linear (matmul,
    then add) would otherwise promote the output to float32 through the float32 bias."""
    experts = DenseExperts(8, 64, 5, dropout=0.5).train()
    params = {key: value.detach().expand(P, *value.shape) for key, value in experts.named_parameters()}
    x = torch.randn(32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        alone = experts(x)
        packed = vmap(lambda params, x: functional_call(experts, params, (x,)), in_dims=(0, None),
                      randomness="different")(params, x)
    assert alone.dtype == packed.dtype == torch.bfloat16


def test_packed_adam_equals_torch_adam_per_trial() -> None:
    """Given the same gradients, each trial's row follows ``torch.optim.Adam(fused=True)`` (what ``fit`` uses; the
    same kernel, whose vectorised and scalar paths may round the last bit differently) and the default
    ``torch.optim.Adam``, each with the trial's own lr and eps; a skipped parameter stays as Adam leaves a parameter
    without gradient."""
    settings = [(1e-3, 1e-7), (3e-2, 1e-8), (5e-4, 1e-3)]

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    fused, plain, packed = ([model(p) for p in range(P)] for _ in range(3))
    optimizers = [(torch.optim.Adam(f.parameters(), lr=lr, eps=eps, fused=True),
                   torch.optim.Adam(u.parameters(), lr=lr, eps=eps)) for f, u, (lr, eps) in zip(fused, plain, settings)]
    stack = TrialStack(packed[0], P, "cpu")
    adam = PackedAdam(stack)
    for slot, (module, (lr, eps)) in enumerate(zip(packed, settings)):
        stack.load(slot, module)
        adam.reset(slot, lr, eps)
    generator = torch.Generator().manual_seed(0)
    for step in range(40):
        skip = step >= 20  # from step 20, trial 1 leaves its last layer's bias alone (no gradient)
        grads = {name: torch.randn(leaf.shape, generator=generator) for name, leaf in stack.params.items()}
        for name, leaf in stack.params.items():
            leaf.grad = grads[name].clone()
        adam.step(list(range(P)), {1: ["2.bias"]} if skip else None)
        for p in range(P):
            for module, optimizer in zip((fused[p], plain[p]), optimizers[p]):
                for name, param in module.named_parameters():
                    skipped = skip and p == 1 and name == "2.bias"
                    param.grad = None if skipped else grads[name][p].clone()
                optimizer.step()
    for p in range(P):
        for (key, value), reference, default in zip(packed[p].named_parameters(), fused[p].parameters(),
                                                     plain[p].parameters()):
            assert torch.allclose(value, reference, rtol=0, atol=1e-7), key
            assert torch.allclose(value, default, rtol=0, atol=1e-6), key


# ==============================================================================================================
# A whole packed fit against ``fit``
# ==============================================================================================================

def fit_args(root, log_dir, gate: str, seed: int, lr: float, extra: list[str]) -> list[str]:
    return ["--data", "movielens-100k", "--gate", gate, f"--seed_everything={seed}", f"--data.root={root}",
            "--data.batch_size=64", "--model.expert_dropout=0", "--trainer.max_epochs=6",
            "--early_stopping.patience=2", f"--model.lr={lr}", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.enable_checkpointing=false",
            f"--trainer.logger.init_args.save_dir={log_dir}", *extra]


CONFIGURATIONS = [(1, 1e-3, ["--model.alpha=0.1"]), (2, 3e-3, []), (3, 5e-4, ["--model.alpha=0.5"]),
                  (4, 2e-3, ["--model.adam_eps=0"])]  # Adam without epsilon diverges on this data


@pytest.mark.parametrize("gate", ["comet", "topk+"])
def test_a_packed_fit_reports_what_fit_reports_alone(tiny_root, tmp_path, gate: str) -> None:
    """Four configurations in a pack of two slots (the third and fourth refill freed slots, then the pack shrinks
    to its last running trial): each reports the epochs, best epoch, objective and best weights' test metrics of its
    own ``fit``, and the diverging one fails without disturbing the others."""
    from mtmoe.pack.train import PackTrainer, PackTrial
    from mtmoe.run import build_run

    def configuration(i: int) -> list[str]:
        seed, lr, extra = CONFIGURATIONS[i]
        return fit_args(tiny_root, tmp_path / "runs", gate, seed, lr,
                        extra + ([f"--model.perm_epochs={i + 1}"] if gate.endswith("+") else []))

    alone = []
    for i in range(len(CONFIGURATIONS)):
        run = build_run(configuration(i))
        alone.append((run.fit(), run.model.diverged))
    queue, results = [], {}
    for i in range(len(CONFIGURATIONS)):
        run = build_run(configuration(i))
        queue.append(PackTrial(i, run.model, run.datamodule.seed, run.trainer.max_epochs, 2))
    data = run.datamodule
    data.setup()
    trainer = PackTrainer(data.splits, 64, 64, capacity=2)
    trainer.run(lambda: queue.pop(0) if queue else None, lambda result: results.__setitem__(result.key, result))
    assert trainer.capacity == 1  # the last trial finished alone: the pack shrank to it, its state moved along
    assert sorted(results) == list(range(len(CONFIGURATIONS)))
    for i, (expected, diverged) in enumerate(alone):
        packed = results[i]
        if diverged is not None:
            assert packed.diverged is not None and packed.diverged.split(" at ")[0] in diverged
            continue
        assert packed.diverged is None
        got = packed.results
        assert (got["epochs_run"], got["best_epoch"]) == (expected["epochs_run"], expected["best_epoch"])
        assert got["best_val_loss"] == pytest.approx(expected["best_val_loss"], rel=1e-5)
        assert got["val"]["loss"] == pytest.approx(expected["best_val_loss"], rel=1e-5)  # the best weights' val
        n_test = len(data.splits["test"]["watch"])
        for key, value in expected["test"].items():
            # this barely trained model's predictions sit close together: rounding may flip one at the 0.5 threshold
            # (accuracy: within two test rows) or swap two close ones (AUC: within 1e-3)
            tolerance = 2.5 / n_test if "accuracy" in key else 1e-3 if "auroc" in key else 1e-6
            assert got["test"][key] == pytest.approx(value, rel=1e-4, abs=tolerance), (i, key)
    assert any(d is not None for _, d in alone) and sum(d is None for _, d in alone) >= 2
