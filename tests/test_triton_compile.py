"""Every Triton kernel of ``mtmoe`` compiled ahead of time for real GPUs, on a CPU: ``triton.compile`` for sm_90
(H100) and sm_80 (A100), each launch signature the code uses, a cubin asserted for each (Triton ships ptxas).

The signatures are recorded, not listed by hand: a process with ``TRITON_INTERPRET=1`` runs the code that launches the
kernels (:func:`record_launches`: dropout in every dtype it takes, the expert layer's epilogue and its mixing in their
dtypes with and without dropout (and the mixing's sums), the sum of the bottom's readers' gradients (float32 and
bfloat16, two to eight of them), the Sinkhorn forward and backward for the search spaces' expert counts and 33,
COMET's reach and its backward (float32 and bfloat16, those expert counts and 4 and 5, k 1 and 2), the packed Adam
at pack sizes 1, 3 and 16, with and without bfloat16 copies and gradients, and its per-block kernel reading
gradients where they lie, float32 and bfloat16, transposed and contiguous) with each kernel's ``run`` wrapped to
note its arguments (a tensor's dtype and alignment, a number's value, the constexprs and options). The test replays each
through Triton's own argument binder for the target, which gives the types, constexprs and specialisations (an int's
divisibility by 16 or value 1, a pointer's alignment) a launch on that GPU gets, and compiles them. A kernel launched
(``name[grid](...)``) from code this recording does not reach fails the test. The same launches are compiled for sm_90
by the oldest Triton supported, the lent GPUs' (``MTMOE_OLDEST_TRITON``: ``.ci/run`` installs it beside this one).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

ROOT = Path(__file__).resolve().parent.parent
TARGETS = [("cuda", 90, 32), ("cuda", 80, 32)]
#: The environment variable naming a folder that holds the oldest supported Triton (``.ci/run`` installs it there).
OLDEST_TRITON = "MTMOE_OLDEST_TRITON"
#: The element-wise kernels over a layer's activations: where their sizes are divisible by 16 (MovieLens' [P, 512,
#: 4096]), their contiguous loads compile to 128-bit ones (``ld.global.v4`` or ``.v2`` of 64-bit words), a quarter of
#: the memory instructions: their sizes are specialised, not ``do_not_specialize``.
VECTORISED = {"_epilogue_cuda", "_epilogue_backward_cuda", "_mix_backward_cuda", "_dropout_cuda", "_sum_cuda",
              "_mixed_forward_cuda", "_mix_backward_sums_cuda"}


def kernel_modules() -> list[str]:
    """The modules of ``mtmoe`` that define Triton kernels (their source holds ``triton.jit``)."""
    return sorted(".".join(path.relative_to(ROOT).with_suffix("").parts) for path in (ROOT / "mtmoe").rglob("*.py")
                  if "@triton.jit" in path.read_text())


def kernels() -> dict[str, object]:
    """Every kernel (a Triton ``KernelInterface``: compiled or interpreted) of :func:`kernel_modules`, by name."""
    from triton.runtime.jit import KernelInterface

    found = {}
    for name in kernel_modules():
        module = importlib.import_module(name)
        found.update({f"{name}.{attr}": value for attr, value in vars(module).items()
                      if isinstance(value, KernelInterface)})
    return found


def launches(name: str) -> list[str]:
    """What follows ``kernel[`` at each launch of kernel ``name`` (``module.kernel``) in its module's source."""
    module, kernel = name.rsplit(".", 1)
    source = importlib.import_module(module).__loader__.get_source(module)
    return [match.group(1) for match in re.finditer(rf"\b{re.escape(kernel)}\[(.{{0,5}})", source)]


def launched_names() -> set[str]:
    """The kernels some code of ``mtmoe`` launches: ``name[grid](...)`` in their module's source."""
    return {name for name in kernels() if launches(name)}


def _note(value):
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "offset": value.data_ptr() % 16}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"a launch argument of type {type(value).__name__}: teach _note and _replay it")


def record_launches() -> None:
    """Run with ``TRITON_INTERPRET=1``: the launch sites of every kernel on CPU tensors; prints the launches as one
    JSON list of ``{kernel, args, kwargs}``."""
    import yaml

    from mtmoe import epilogue, mixing, shared_input, sinkhorn, triton_support
    from mtmoe import random as streams
    from mtmoe.pack.adam import PackedAdam
    from mtmoe.pack.stack import TrialStack

    assert triton_support.INTERPRET
    launches = []
    for name, kernel in kernels().items():
        def recording(*args, grid, warmup, _run=kernel.run, _name=name, **kwargs):
            launches.append({"kernel": _name, "args": [_note(a) for a in args],
                             "kwargs": {k: _note(v) for k, v in kwargs.items()}})
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = recording
    shapes = ((2, 3, 40), (2, 4, 64))  # sizes specialised by their divisibility by 16: neither, and all
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):  # dropout's dtypes (autocast: 16-bit)
        for shape in shapes:
            h = torch.randn(shape).to(dtype).requires_grad_()
            for site in range(4):  # lanes H(2 site), H(2 site + 1) on either side of 2^31
                streams.dropout(h, torch.tensor(site + 5), site, torch.tensor(3), 0.25).sum().backward()
    for dtype in (torch.float32, torch.float64, torch.bfloat16):  # the expert layer's epilogue (autocast: bf16)
        for shape in shapes:
            y, bias = torch.randn(shape).to(dtype).requires_grad_(), torch.randn(2, shape[-1]).to(dtype)
            for p in (0.25, 0.0):
                epilogue.bias_relu_dropout(y, bias, p, torch.tensor([5, 6]), torch.tensor(3), 1).sum().backward()
                weights = torch.rand(*shape[:2], 2, 4).to(dtype).requires_grad_()  # the mixing: 4 experts, 2 tasks
                mixing.mixed_experts(y, bias, weights, p, torch.tensor([5, 6]), torch.tensor(3), 1).sum().backward()
                if dtype != torch.float64:  # the mixing's sums too (--model.fused_mixing_sums)
                    mixing.mixed_experts(y, bias, weights, p, torch.tensor([5, 6]), torch.tensor(3), 1,
                                         sums=True).sum().backward()
    for dtype in (torch.float32, torch.bfloat16):  # the mixing's sums at a recommender's experts' width (256 units)
        y, bias = torch.randn(2, 3, 512).to(dtype).requires_grad_(), torch.randn(2, 512).to(dtype)
        weights = torch.rand(2, 3, 2, 2).to(dtype).requires_grad_()
        mixing.mixed_experts(y, bias, weights, 0.25, torch.tensor([5, 6]), torch.tensor(3), 1,
                             sums=True).sum().backward()
    for dtype in (torch.float32, torch.bfloat16):  # the bottom's readers' gradients (autocast: bf16)
        for count in range(2, shared_input.MAX_KERNEL_READERS + 1):
            for shape in ((2, 3, 41), (2, 3, 40)):
                shared_input.summed([torch.randn(shape).to(dtype) for _ in range(count)], torch.float32)
    n_experts = sorted({yaml.safe_load(path.read_text())["fixed"]["model.n_experts"]
                        for path in (ROOT / "mtmoe" / "tuning" / "spaces").glob("*.yaml")} | {33})  # 33: BLOCK 64,
    # as the CUDA tests of tests/test_sinkhorn.py launch it
    for dtype in (torch.float32, torch.float64):  # the permutation's log-weights: a float parameter
        for n in n_experts:
            u = torch.randn(2, n, n, dtype=dtype, requires_grad=True)
            p, penalty = sinkhorn.sinkhorn_and_penalty(u, 0.5, 3, 1e-3)
            (p.sum() + penalty).backward()
    from mtmoe.gates.comet import path_index
    from mtmoe.gates.reach import reach

    for n in sorted(set(n_experts) - {33} | {4, 5}):  # COMET's reach: the spaces' expert counts, and the tests'
        for k in (1, 2):  # k is not specialised
            for dtype in (torch.float32, torch.bfloat16):  # float32 in a pack, bfloat16 alone under autocast
                t = torch.randn(2, 3, (n - 1) * k).to(dtype).requires_grad_()
                reach(t, 1.0, path_index(n)).transpose(-1, -2).sum().backward()
    for capacity in (1, 3, 16):
        net = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3))
        stack = TrialStack(net, capacity, "cpu")
        adam = PackedAdam(stack)
        for slot in range(capacity):
            stack.load(slot, net)
            adam.reset(slot, 1e-3, 1e-8)
        stack.flat_grad.normal_()
        adam.step({"1.weight": torch.zeros(capacity, dtype=torch.bool)})
        adam.bfloat16_copies(frozenset({"0.weight", "0.bias"}))  # the copies a step under bf16 autocast reads
        adam.step(copies=True)
        adam.bfloat16_gradients()  # and reads their gradients in bfloat16
        adam.step(copies=True, gradients=True)
    for net in (torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3)),  # the gradients read where
                torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))):  # they lie, strides of 16 too
        stack = TrialStack(net, 3, "cpu")
        adam = PackedAdam(stack)
        for slot in range(3):
            stack.load(slot, net)
            adam.reset(slot, 1e-3, 1e-8)
        kept = {name: torch.randn(3, *p.shape[::-1]).transpose(-1, -2) if p.dim() == 2 else torch.randn(3, *p.shape)
                for name, p in net.named_parameters()}  # the weights' gradients transposed, as a linear layer's
        adam.step(kept=kept)
        adam.bfloat16_copies(frozenset({"0.weight", "0.bias"}))
        adam.bfloat16_gradients()
        adam.step(copies=True, gradients=True, kept={**kept, "0.weight": kept["0.weight"].to(torch.bfloat16),
                                                     "0.bias": kept["0.bias"].to(torch.bfloat16)})
    print(json.dumps(launches))


def _replay(note):
    if isinstance(note, dict):
        dtype = getattr(torch, note["dtype"])
        base = torch.empty(64, dtype=dtype)
        return base[note["offset"] // base.element_size():]
    return note


def bind(kernel, launch: dict, target) -> tuple[tuple, dict]:
    """What a launch of ``kernel`` with the recorded arguments compiles on ``target``: ``ASTSource``'s signature,
    constexprs and attributes, and the options, as ``JITFunction.run`` derives them."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    args, kwargs = [_replay(a) for a in launch["args"]], launch["kwargs"]
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return (signature, constexprs, attrs), options.__dict__


def compile_launches(launches: list[dict], targets: list[tuple]) -> tuple[dict[str, int], set[str]]:
    """``triton.compile`` of each distinct signature of the recorded ``launches`` for each of ``targets``, a cubin
    and PTX for that architecture asserted for each: the cubins per kernel, and the kernels some of whose loads
    compiled to 128-bit (or 64-bit pairs) ones."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    found = kernels()
    compiled, vectorised = set(), set()
    for launch in launches:
        kernel = found[launch["kernel"]]
        for target in (GPUTarget(*t) for t in targets):
            (signature, constexprs, attrs), options = bind(kernel, launch, target)
            key = (launch["kernel"], target.arch, json.dumps([signature, sorted(map(str, constexprs.items())),
                                                              sorted(map(str, attrs.items())), sorted(
                                                                  map(str, options.items()))]))
            if key in compiled:
                continue
            binary = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)
            assert binary.asm["cubin"][:4] == b"\x7fELF", key
            assert f".target sm_{target.arch}" in binary.asm["ptx"], key
            compiled.add(key)
            if re.search(r"\bld\.global\.v[24]\.", binary.asm["ptx"]):
                vectorised.add(launch["kernel"].rsplit(".", 1)[1])
    return {name: sum(k[0] == name for k in compiled) for name in sorted(launched_names())}, vectorised


def last_line_of(call: str, env: dict[str, str]) -> str:
    """The last line ``call`` (a call of a function of this module) prints, run in a Python process of its own with
    ``env``, which must succeed."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_triton_compile as t; t.{call}"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """:func:`record_launches`' JSON, run once in a process of its own under Triton's interpreter, in a file."""
    path = tmp_path_factory.mktemp("launches") / "launches.json"
    path.write_text(last_line_of("record_launches()", {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}))
    return path


@pytest.mark.integration  # a Python process of its own, importing torch and Triton's interpreter: CI, not the inner loop
@pytest.mark.xdist_group("triton_compile")  # one worker: one recording for both compilations
def test_every_kernel_compiles_for_sm90_and_sm80_in_every_launched_signature(recorded: Path) -> None:
    launches = json.loads(recorded.read_text())
    found = kernels()
    assert {launch["kernel"] for launch in launches} == launched_names()
    reached, helpers = launched_names(), set(found) - launched_names()
    while True:  # every helper is called by a launched kernel, or by a helper one calls
        called = "\n".join(found[name].src for name in reached)
        more = {name for name in helpers - reached if re.search(rf"\b{name.rsplit('.', 1)[1]}\(", called)}
        if not more:
            break
        reached |= more
    assert helpers <= reached, helpers - reached
    per_kernel, vectorised = compile_launches(launches, TARGETS)
    print(f"compiled {sum(per_kernel.values())} cubins (sm_90 and sm_80) of {len(per_kernel)} kernels: {per_kernel}")
    assert all(per_kernel.values())
    assert VECTORISED <= vectorised, VECTORISED - vectorised


def compile_with_oldest_triton(launches_file: str) -> None:
    """Run with the oldest supported Triton first on the path: :func:`compile_launches` of the recorded launches for
    sm_90; prints the version and the count as one JSON line."""
    import triton

    per_kernel, vectorised = compile_launches(json.loads(Path(launches_file).read_text()), [TARGETS[0]])
    print(json.dumps({"triton": triton.__version__, "file": triton.__file__, "cubins": sum(per_kernel.values()),
                      "kernels": per_kernel, "vectorised": sorted(vectorised)}))


@pytest.mark.integration  # as above, with another Triton
@pytest.mark.xdist_group("triton_compile")
@pytest.mark.skipif(not os.environ.get(OLDEST_TRITON), reason=f"{OLDEST_TRITON} names no folder (.ci/run sets it)")
def test_every_kernel_compiles_for_sm90_with_the_oldest_supported_triton(recorded: Path) -> None:
    """The lent GPUs' image has the oldest Triton of :data:`~mtmoe.triton_support.SUPPORTED_VERSIONS` (3.6), older
    than this machine's: each launch recorded here (by this Triton's interpreter: 3.6's fails on this numpy) compiled
    for sm_90 (the H100 and H200) by that Triton, installed with ``pip install --no-deps --target`` into the folder
    :data:`OLDEST_TRITON` names, first on the path of a process of its own. A kernel a lease's Triton would refuse
    fails here, before the lease."""
    from mtmoe.triton_support import SUPPORTED_VERSIONS

    folder = Path(os.environ[OLDEST_TRITON]).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(folder), os.environ.get("PYTHONPATH"))))}
    env.pop("TRITON_INTERPRET", None)
    found = json.loads(last_line_of(f"compile_with_oldest_triton({str(recorded)!r})", env))
    print(f"Triton {found['triton']} compiled {found['cubins']} cubins (sm_90) of {len(found['kernels'])} kernels")
    assert Path(found["file"]).is_relative_to(folder), found["file"]
    assert found["triton"].split(".")[:2] == SUPPORTED_VERSIONS["triton"][0].split("."), found["triton"]
    assert set(found["kernels"]) == launched_names() and all(found["kernels"].values()), found["kernels"]
    assert VECTORISED <= set(found["vectorised"]), VECTORISED - set(found["vectorised"])


def test_every_launch_grid_is_checked_against_cudas_limits() -> None:
    """Triton's interpreter runs a grid of any size, a GPU refuses one past CUDA's limits ("invalid argument", as a
    pack's rows did on the second dimension in a lease): every launch in ``mtmoe`` goes through
    :func:`mtmoe.triton_support.grid`, which raises on this CPU too, naming the dimension."""
    from mtmoe.triton_support import GRID_LIMITS, grid

    launched = launched_names()
    unchecked = [f"{name}[{start}" for name in launched for start in launches(name) if not start.startswith("grid(")]
    assert launched and not unchecked, unchecked
    assert grid(GRID_LIMITS[0], 65_535, 1) == (GRID_LIMITS[0], 65_535, 1)
    for dims, axis in (((2, 65_536), "y"), ((1, 1, 70_000), "z"), ((2**31, 1), "x")):
        with pytest.raises(ValueError, match=f"programs along {axis}, past CUDA's limit"):
            grid(*dims)
