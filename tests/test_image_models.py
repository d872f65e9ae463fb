"""CNN experts and the image models (S1.2): grouped experts equal separate CNNs, shapes per dataset, every gate
and every "+" variant trains on an image dataset's fixture, multiclass metrics, the CLI, the search spaces."""
from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import run_cli
from covering import variants_over
from image_fixtures import write_celeba, write_mnist, write_svhn
from mtmoe.data.celeba import CelebADataModule
from mtmoe.data.digits import DigitsDataModule
from mtmoe.data.multimnist import MultiFashionMNISTDataModule, MultiMNISTDataModule
from mtmoe.errors import UsageError
from mtmoe.experts import ConvExperts, GroupedLinear
from mtmoe.gates import gate_class, gate_variants
from mtmoe.lit.module import MultiTaskMoE
from mtmoe.pack.settings import ModelSettings
from mtmoe.mmoe import build_mmoe
from mtmoe.tuning.space import SPACES_DIR, load_space

MODULES = {
    "multimnist": MultiMNISTDataModule, "multifashionmnist": MultiFashionMNISTDataModule,
    "celeba": CelebADataModule, "digits": DigitsDataModule,
}
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(scope="module")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    write_mnist(root)
    write_mnist(root, name="FashionMNIST", seed=1)
    write_svhn(root)
    write_celeba(root)
    return root


@pytest.fixture(scope="module")
def datamodules(image_root: Path) -> dict:
    """Each dataset's fixture, prepared once for the module (batches of 16)."""
    modules = {}
    for name, cls in MODULES.items():
        modules[name] = cls(root=str(image_root), cache_dir=str(image_root / "cache"), download=False, batch_size=16)
        modules[name].setup()
    return modules


def separate_expert(experts: ConvExperts, i: int) -> nn.Sequential:
    """Expert i as a stand-alone CNN (``nn.Conv2d``/``nn.Linear`` layers) holding copies of its weights."""
    layers: list[nn.Module] = []
    for conv in experts.convs:
        filters = conv.out_channels // experts.n_experts
        single = nn.Conv2d(conv.in_channels // conv.groups, filters, conv.kernel_size)
        single.weight.data = conv.weight[i * filters : (i + 1) * filters].clone()
        single.bias.data = conv.bias[i * filters : (i + 1) * filters].clone()
        layers += [single, nn.ReLU(), nn.MaxPool2d(2)]
    layers.append(nn.Flatten())
    for dense in experts.dense:
        single = nn.Linear(dense.in_features, dense.out_features)
        single.weight.data = dense.weight[i].t().clone()
        single.bias.data = dense.bias[i].clone()
        layers += [single, nn.ReLU()]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("name", MODULES)
def test_grouped_experts_equal_separate_cnns(name: str) -> None:
    """Same outputs and same parameter gradients as n separate CNNs (S1.2 architecture of each dataset)."""
    info = MODULES[name](download=False).info
    torch.manual_seed(0)
    experts = ConvExperts(info.image_shape, info.conv_layers, info.expert_units, info.expert_layers, info.n_experts)
    x = torch.rand(5, *info.image_shape)
    out = experts(x)
    assert out.shape == (5, info.n_experts, experts.out_features)
    coefficients = torch.randn_like(out)
    (out * coefficients).sum().backward()
    for i in range(info.n_experts):
        single = separate_expert(experts, i)
        expected = single(x)
        torch.testing.assert_close(out[:, i], expected, rtol=1e-5, atol=1e-6)
        (expected * coefficients[:, i]).sum().backward()
        conv, dense = single[0], [m for m in single if isinstance(m, nn.Linear)]
        filters = conv.out_channels
        torch.testing.assert_close(experts.convs[0].weight.grad[i * filters : (i + 1) * filters], conv.weight.grad,
                                   rtol=1e-4, atol=1e-6)
        for grouped, linear in zip(experts.dense, dense):
            torch.testing.assert_close(grouped.weight.grad[i], linear.weight.grad.t(), rtol=1e-4, atol=1e-6)


def test_grouped_linear_is_n_linears() -> None:
    torch.manual_seed(0)
    layer = GroupedLinear(3, 7, 4)
    x = torch.randn(6, 3, 7)
    expected = torch.stack([x[:, i] @ layer.weight[i] + layer.bias[i] for i in range(3)], dim=1)
    torch.testing.assert_close(layer(x), expected)
    assert layer.weight.abs().max() <= 1 / math.sqrt(7)  # nn.Linear's default bound per expert


def test_keras_init_bounds_are_per_expert() -> None:
    """Glorot-uniform with each expert's own fans (a grouped conv's fan-out is not n times an expert's)."""
    torch.manual_seed(0)
    experts = ConvExperts((1, 36, 36), ((5, 10), (5, 20)), 50, 2, 16)
    experts.keras_init_()
    bounds = [math.sqrt(6 / (25 * 1 + 25 * 10)), math.sqrt(6 / (25 * 10 + 25 * 20))]
    for conv, bound in zip(experts.convs, bounds):
        assert 0.95 * bound < conv.weight.abs().max() <= bound and conv.bias.eq(0).all()
    for dense, bound in zip(experts.dense, [math.sqrt(6 / (720 + 50)), math.sqrt(6 / (50 + 50))]):
        assert 0.95 * bound < dense.weight.abs().max() <= bound and dense.bias.eq(0).all()


@pytest.mark.parametrize(
    "name, expert_params, out_features, routing_features, prediction_shape",
    [  # S1.2: parameters of one expert; expert output size; the gates read the raw image flattened
        ("multimnist", 260 + 5_020 + 36_050 + 2_550, 50, 1296, (16, 10)),
        ("multifashionmnist", 260 + 5_020 + 36_050 + 2_550, 50, 1296, (16, 10)),
        ("celeba", 112 + 148 + 148 + 37, 4, 3 * 64 * 64, (16,)),
        ("digits", 760 + 5_020 + 25_050, 50, 3 * 32 * 32, (16, 10)),
    ],
)
def test_model_shapes(name, expert_params, out_features, routing_features, prediction_shape, datamodules) -> None:
    data = datamodules[name]
    info = data.info
    model = build_mmoe(info, partial(gate_class("softmax")))
    assert sum(p.numel() for p in model.experts.parameters()) == info.n_experts * expert_params
    assert model.experts.out_features == out_features
    assert all(gate.dims.in_features == routing_features for gate in model.gates)
    assert len(model.gates) == len(model.towers) == len(info.tasks)
    batch = next(iter(data.train_dataloader()))
    assert batch["image"].dtype == torch.uint8
    assert model.experts(model.bottom(batch)).shape == (16, info.n_experts, out_features)
    output = model(batch)
    assert [tuple(p.shape) for p in output.predictions] == [prediction_shape] * len(info.tasks)


def test_image_model_argument_errors() -> None:
    with pytest.raises(UsageError, match="too small"):
        build_mmoe(CelebADataModule(image_size=40, download=False).info, partial(gate_class("topk")))
    with pytest.raises(UsageError, match="embedding_dim applies to the recommenders only"):
        build_mmoe(MultiMNISTDataModule(download=False).info, partial(gate_class("topk")), embedding_dim=8)


def test_hash_routes_images_by_sample_id(datamodules) -> None:
    data = datamodules["multimnist"]
    model = build_mmoe(data.info, partial(gate_class("hash"), seed=3))
    batch = next(iter(data.train_dataloader()))
    gate = model.gates[0]
    assert gate.table.shape == (140_000,)
    for output in model(batch).gates:
        assert torch.equal(output.weights, F.one_hot(gate.table[batch["sample_id"]], 16).float())


@pytest.mark.parametrize("gate, name", variants_over(list(MODULES)))
def test_every_gate_trains_on_an_image_dataset(name: str, gate: str, datamodules) -> None:
    """Every gate and "+" variant trains on one image dataset, a gate and its "+" on different ones
    (``tests/covering.py``): each dataset trains several, CNN experts included; the gates at each dataset's number
    of experts are in ``test_gates_registry.py`` (n of 2 to 16), and comet+ on every dataset through the CLI below."""
    data = datamodules[name]
    info = data.info
    pl.seed_everything(0, verbose=False)
    model = MultiTaskMoE.build(info, ModelSettings(gate=partial(gate_class(gate.removesuffix("+"))), lr=1e-3,
                                                   perm_epochs=1 if gate.endswith("+") else None))
    before = model.net.experts.convs[0].weight.detach().clone()
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, **QUIET)
    trainer.fit(model, datamodule=data)
    val = model.last_results["val"]
    assert math.isfinite(val["loss"]) and not torch.equal(before, model.net.experts.convs[0].weight)
    task = info.tasks[0].name
    expected = {"softmax": info.n_experts, "hash": 1, "topk": info.k}.get(gate.removesuffix("+"))
    if expected is not None:
        assert val[f"{task}/experts_per_sample"] == pytest.approx(expected)
    if gate.endswith("+"):
        assert model.net.local_search.frozen


def test_multiclass_loss_and_accuracy_end_to_end(datamodules) -> None:
    """Logged test accuracy and cross-entropy equal a direct computation over the test split."""
    data = datamodules["multimnist"]
    pl.seed_everything(0, verbose=False)
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class("topk")), lr=3e-3))
    trainer = pl.Trainer(max_epochs=2, **QUIET)
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data, verbose=False)
    results = model.last_results["test"]
    model.eval()
    with torch.no_grad():
        batches = list(data.test_dataloader())
        outputs = [model(batch).predictions for batch in batches]
    for t, task in enumerate(("top_left", "bottom_right")):
        logits = torch.cat([o[t] for o in outputs])
        target = torch.cat([b[task] for b in batches])
        assert results[f"{task}/accuracy"] == pytest.approx((logits.argmax(1) == target).float().mean().item())
        assert results[f"{task}/loss"] == pytest.approx(F.cross_entropy(logits, target).item(), rel=1e-5)
    assert results["loss_dataset"] == pytest.approx(0.5 * results["top_left/loss"] + 0.5 * results["bottom_right/loss"])


@pytest.mark.parametrize("name", MODULES)
def test_cli_fit_plus_gate(name: str, image_root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code = run_cli(["fit", "--gate", "comet+", "--data", name, f"--data.root={image_root}",
                    f"--data.cache_dir={image_root / 'cache'}", "--data.batch_size=16", "--trainer.max_epochs=1",
                    "--trainer.limit_train_batches=2", "--trainer.enable_progress_bar=false",
                    "--trainer.enable_model_summary=false", "--model.perm_epochs=1"])
    assert code == 0
    assert f"comet+ on {name}" in capsys.readouterr().out
    results = json.loads(next(Path("runs").rglob("results.json")).read_text())
    task = MODULES[name](download=False).info.tasks[0]
    metric = "accuracy" if task.kind == "multiclass" else "auroc"
    assert 0.0 <= results["test"][f"{task.name}/{metric}"] <= 1.0 and "assignment" in results["permutation"]


def test_alpha_is_refused_for_equally_weighted_images(image_root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code = run_cli(["fit", "--gate", "topk", "--data", "digits", f"--data.root={image_root}", "--model.alpha=0.5"])
    assert code == 2 and "digits weights its tasks equally" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trains_on_gpu_with_uint8_batches(datamodules) -> None:
    data = datamodules["multimnist"]
    model = MultiTaskMoE.build(data.info, ModelSettings(gate=partial(gate_class("comet")), lr=1e-3, perm_epochs=1))
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.append((batch["image"].dtype, batch["image"].device.type))

    trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                         callbacks=[Spy()], **QUIET)
    trainer.fit(model, datamodule=data)
    assert seen == [(torch.uint8, "cuda")] * 2 and math.isfinite(model.last_results["val"]["loss"])


# ------------------------------------------------------------------------------------------------ search spaces


@pytest.mark.parametrize(
    "name, lr, epochs, trials, n_experts, k, comet_plus_gamma",
    [  # Supplement S1.3 (MultiFashionMNIST: 5 experts, see studies/multifashionmnist.yaml)
        ("multimnist", (1e-4, 1e-3), 200, 500, 16, 4, 0.01),
        ("multifashionmnist", (1e-4, 1e-3), 200, 500, 5, 2, 0.01),
        ("celeba", (1e-4, 1e-3), 100, 100, 6, 2, 5),
        ("digits", (1e-5, 5e-4), 200, 500, 8, 2, 0.001),
    ],
)
def test_image_search_spaces(name, lr, epochs, trials, n_experts, k, comet_plus_gamma) -> None:
    import yaml

    path = SPACES_DIR / f"{name}.yaml"
    assert set(yaml.safe_load(path.read_text())["gates"]) <= set(gate_variants())
    for gate in gate_variants():  # with a section or not: the file's defaults give a gate without one its lr
        space = load_space(name, gate, path)
        assert space.trials == trials and space.fixed["trainer.max_epochs"] == epochs
        assert space.fixed["data.batch_size"] == 512 and space.fixed["early_stopping.patience"] == 25
        assert space.fixed["model.n_experts"] == n_experts and "model.alpha" not in space.fixed
        distribution = space.distributions["model.lr"]
        assert (distribution.low, distribution.high, distribution.log) == (*lr, True)
        if "model.gate.k" in space.fixed:
            assert space.fixed["model.gate.k"] == k
        assert ("model.perm_epochs" in space.distributions) == gate.endswith("+")
    assert load_space(name, "comet+", path).fixed["model.gate.gamma"] == comet_plus_gamma


def test_cpu_convolutions_get_a_channels_last_weight() -> None:
    """The speed-up of ``ConvExperts._layout`` depends on a really channels-last weight, also with one input channel
    (where ``contiguous(memory_format=channels_last)`` is a no-op); values are unchanged."""
    weight = torch.randn(160, 1, 5, 5)
    laid_out = ConvExperts._layout(weight)
    assert laid_out.stride() == (25, 1, 5, 1) and torch.equal(laid_out, weight)
    x = torch.rand(3, 1, 36, 36)
    assert torch.nn.functional.conv2d(x, laid_out).stride()[1] == 1  # the convolution's output is NHWC too
