"""The package's layers: the model core trains without Lightning, every import points down, no import circle.

Layers, bottom to top (a module may import its own layer and those below it, never one above):

* core: plain PyTorch, what the model is built from (gates, experts, MMoE, local search and its Sinkhorn, the
  random streams, the dataset description); no Lightning, torchmetrics, pandas or torchvision;
* the training engine (``mtmoe.pack``: the packed step, Adam, metrics, CUDA graphs), plain PyTorch too;
* components: the DataModules (``mtmoe.data``) and the LightningModules over the engine and callbacks
  (``mtmoe.lit``);
* the run builder (``mtmoe.run``, its settings checked in ``mtmoe.run_settings``, its command line's names checked
  before torch loads in ``mtmoe.arguments``): ``fit`` arguments -> DataModule, LightningModule, Trainer;
* recipes on runs: tuning (search spaces, the tune driver and its worker, storage, trial table, report, bootstrap);
* the command line (``mtmoe.cli``, ``python -m mtmoe``).
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import mtmoe

PACKAGE = Path(mtmoe.__file__).resolve().parent
LAYERS = {  # module or package prefix -> layer (0 = bottom)
    "mtmoe": 0, "mtmoe.errors": 0, "mtmoe.files": 0, "mtmoe.scalars": 0, "mtmoe.random": 0, "mtmoe.dataset_info": 0,
    "mtmoe.losses": 0, "mtmoe.host_memory": 0, "mtmoe.host_threads": 0, "mtmoe.gate_names": 0, "mtmoe.interrupts": 0,
    "mtmoe.triton_support": 0, "mtmoe.plain_kernels": 0, "mtmoe.discovery": 0, "mtmoe.kernel_traffic": 0,
    "mtmoe.routing_names": 0, "mtmoe.code_version": 0,
    "mtmoe.epilogue": 0, "mtmoe.mixing": 0, "mtmoe.shared_input": 0,
    "mtmoe.gates": 0, "mtmoe.experts": 0, "mtmoe.mmoe": 0, "mtmoe.permutation": 0, "mtmoe.sinkhorn": 0,
    "mtmoe.schedules": 0,
    "mtmoe.pack": 1,
    "mtmoe.data": 2, "mtmoe.lit": 2,
    "mtmoe.run": 3, "mtmoe.run_settings": 3, "mtmoe.arguments": 3,
    "mtmoe.tuning": 4,
    "mtmoe.cli": 5, "mtmoe.__main__": 5, "mtmoe.api": 5,
}
CORE = ["mtmoe.dataset_info", "mtmoe.losses", "mtmoe.gates", "mtmoe.experts", "mtmoe.mmoe", "mtmoe.permutation",
        "mtmoe.sinkhorn", "mtmoe.random", "mtmoe.epilogue", "mtmoe.mixing", "mtmoe.shared_input", "mtmoe.pack.engine",
        "mtmoe.pack.memory"]
NOT_IN_CORE = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "pandas", "torchvision")


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the package's modules, function-level (lazy) ones included."""
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def layer(module: str) -> int:
    prefixes = [p for p in LAYERS if module == p or (p != "mtmoe" and module.startswith(p + "."))]
    assert prefixes, f"{module} has no layer: add it to LAYERS in {__file__}"
    return LAYERS[max(prefixes, key=len)]


def test_every_import_points_down() -> None:
    upward = [f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
              for module, targets in imports(module_names()).items() for target in sorted(targets)
              if layer(target) > layer(module)]
    assert not upward, "\n".join(upward)


def test_no_import_circle() -> None:
    graph = imports(module_names())
    state: dict[str, str] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_model_core_trains_without_lightning_pandas_or_torchvision() -> None:
    """In a fresh interpreter: every gate, with local search where it has one, builds, trains a step and
    evaluates, and none of Lightning, torchmetrics, pandas, torchvision was imported, the engine's modules
    imported too."""
    code = f"""
import json, sys
from functools import partial
import torch
from mtmoe.dataset_info import DatasetInfo, TaskSpec
from mtmoe.gates import gate_class, list_gates
from mtmoe.mmoe import build_mmoe
for module in {CORE!r}:
    __import__(module)
info = DatasetInfo(name="tiny", tasks=(TaskSpec("watch", "binary"), TaskSpec("rating", "regression", masked=True)),
                   n_ids=12, n_users=12, n_items=15, n_experts=4, k=2, embedding_dim=4, expert_units=5,
                   tower_units=3)
user = torch.arange(8) % 12
batch = {{"user": user, "item": torch.arange(8) % 15, "sample_id": user}}
for name in list_gates():
    search = {{"epochs": 1}} if gate_class(name).permutable else None
    model = build_mmoe(info, partial(gate_class(name)), local_search=search)
    if model.local_search is not None:
        model.local_search.set_window(steps_per_epoch=1)
    model.train()
    out = model(batch)
    (sum(p.sum() for p in out.predictions) + out.aux_loss).backward()
    model.eval()
    with torch.no_grad():
        model(batch)
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({NOT_IN_CORE!r}))))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
