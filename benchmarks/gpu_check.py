"""One prepared command for a lent GPU (issue 31): the CUDA tests, the pack throughput in each precision, where
a pack's training step spends its time (its kernels, ``bench_packs.py --profile``) and where an epoch's host time
goes (``--profile-epoch``: the train phase's wall time per step beside the step's kernels'), whether TF32 changes
what a study concludes (``bench_precision.py --variant high``: 32 configurations in float32 and in TF32), the
500-trial MovieLens-100K study of comet at the paper's budget, then Top-k's (:data:`STUDY_GATES`; resumable across
leases), then ``report`` and ``bootstrap``, each step in its own time budget, within 9 minutes.

    python benchmarks/gpu_check.py gather             # here: wheels and data into .gpu/ (git-ignored, carried)
    python3 benchmarks/gpu_check.py run --out DIR     # on the GPU (the exact device call: benchmarks/README.md)
    python benchmarks/gpu_check.py --dry-run          # here: the same steps, tiny, on the CPU, in the interpreter
    python benchmarks/gpu_check.py keep FILES_AT...   # here: what the lease's calls returned, into docs/results

A lent GPU's image has torch and Triton but not the suite's other dependencies, and nothing can be downloaded there:
``gather`` fetches the wheels of :data:`WHEELS` (the versions installed here), copies the MovieLens-100K files into
``.gpu/``, which the device call carries with the working tree, and records the commit with a digest of the tracked
files (a tree changed since names its results ``<commit>+changed-since-gather``). ``run`` installs the wheels, then
runs each step as a subprocess with its own budget (the study: what is left of 9 minutes once the steps after it
have theirs): a step that fails or overruns is logged and the next one runs; ``--steps`` runs some of them. The
study's storage is a journal file in ``.gpu/study/``: the study stops cleanly before its budget ends (SIGTERM:
running trials are marked interrupted and their state saved), its journal comes back in DIR, and carried to the next
lease it resumes; the next call of the same lease resumes it from the copy the machine keeps (:func:`device_paths`),
with no copy back between the calls. The saved states (about 24 MiB a trial: they cannot travel) stay on the device,
outside the carried ``.gpu/``: the next call of the same lease, on the same warm machine, continues the interrupted
trials from their last epoch; a fresh machine reruns them from their first. ``--study`` chooses how the studies
train (:data:`STUDY_SETTINGS`: TF32, the default and the leases' study so far, or bf16 with the mixing's sums
fused); each setting has its own journal, preflight and precision check, so a study never mixes them. DIR receives
``summary.json``, ``summary.md`` (the short table, also printed last), ``logs.tar.gz`` (every step's full log), the
journal gzipped (``study.journal.gz``, TF32's; ``study-<setting>.journal.gz``: a file comes back only under 16 MiB),
``checkpoints.tar.gz`` (if the study left any and the archive is within :data:`RETURN_LIMIT`), ``report.md`` and
``results.tar.gz`` (the report's and the bootstrap's folders): at most 8 files, as the device tool returns.

``--dry-run`` runs :func:`run` itself with :data:`DRY` sizes (2 trials of 1 epoch of 1 batch of 8 rows, 4 experts
of 8 units, embeddings of 4, packs of 2, one profiled step, bands at 50%, Triton's interpreter) on the CPU, the
study in a temporary folder rather than ``.gpu/study``, and the modules of :data:`ABSENT_ON_GPU` unimportable.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout on the device, where the suite is not installed
CARRIED = ROOT / ".gpu"  # travels with the working tree: carry=[".gpu"]
WHEELS_DIR, DATA_DIR, STUDY_DIR = CARRIED / "wheels", CARRIED / "data", CARRIED / "study"
# What a lease's calls keep on the device, per study setting (device_paths): git-ignored and not carried, so kept
# from one call of a lease to the next on the same warm machine (the device tool keeps ignored files between calls;
# carry replaces .gpu/ whole). The study's checkpoints; the preflight's verdict on this machine (the names its tests
# did not pass: a call whose --steps lack the preflight trains the study as the preflight of an earlier call
# decided); the study's journal as the last call left it (carry replaces .gpu/ with this machine's copy, older by
# that call's trials, and the next call resumes from the newer of the two).
ON_DEVICE = ROOT / ".gpu-device"
DATASET, GATE, SOURCE = "movielens-100k", "comet", "ml-100k"  # GATE: the bench's
# The lease's studies, trained in this order, each to its 500 trials: COMET's, then Top-k's, the pair whose
# tuning-trial reduction factor is the paper's Figures 2-3. One journal holds them; report and bootstrap read both.
STUDY_GATES = ("comet", "topk")
# What the suite imports on this path (tune with a journal storage, report, bootstrap, bench_packs, the tests) that
# the GPU image lacks (/work/.library/device/KINDS.md), its missing dependencies included; all pure Python.
WHEELS = ("optuna", "colorlog", "jsonargparse", "docstring_parser", "typeshed_client", "opda")
# The suite's other dependencies, absent there and not carried (RDB storage, the dashboard, Jester's .xls): the
# dry run makes them unimportable, so that a step that would need one on the GPU fails here first.
ABSENT_ON_GPU = ("sqlalchemy", "alembic", "mako", "psycopg2", "optuna_dashboard", "python_calamine")
TREE_LIMIT = 64 * 2**20  # the device tool's limit on the working tree with the carried folders
RETURN_LIMIT = 16 * 2**20  # the device tool's limit on a file it returns from $OUT
# bench_packs.py's options and the trials' fit options for each precision it benchmarks: the one place to add one
PRECISIONS = {"fp32": (["--precision", "32"], ()), "tf32": (["--precision", "32", "--matmul-precision", "high"], ()),
              "bf16": (["--precision", "bf16-mixed"], ()),
              "bf16-fused-sums": (["--precision", "bf16-mixed"], ("--model.fused_mixing_sums=true",))}
# a lease's default: the study's precision, and the fastest configuration (bf16 with the mixing's sums in its
# kernels: not bitwise the default path, so a study setting; the one within 2x of the roofline's floor)
GPU_PRECISIONS = ("tf32", "bf16-fused-sums")
CUDA_TESTS = ["tests/test_engine_cuda.py",
              "tests/test_sinkhorn.py::test_cuda_kernels_equal_the_cpu_loops_without_synchronising",
              "tests/test_sinkhorn.py::test_a_cuda_graph_replays_a_pack_step_with_new_schedules",
              "tests/test_random.py::test_cuda_equals_cpu",
              "tests/test_epilogue.py::test_cuda_equals_cpu",
              "tests/test_mixing.py::test_cuda_equals_cpu",
              "tests/test_mixing_sums.py::test_cuda_equals_cpu",
              "tests/test_shared_input.py::test_cuda_equals_cpu",
              "tests/test_comet_reach.py::test_cuda_equals_cpu",
              "tests/test_plain_kernels.py::test_cuda_all_plain_is_captured_unsynchronised_and_trains_as_fused",
              "tests/test_eval_graphs.py::test_cuda_evaluation_graphs_compute_the_eager_passes_without_synchronising",
              "tests/test_image_models.py::test_trains_on_gpu_with_uint8_batches"]


EVAL_GRAPHS_TEST = ("tests/test_eval_graphs.py::"
                    "test_cuda_evaluation_graphs_compute_the_eager_passes_without_synchronising")


@dataclass(frozen=True)
class StudySetting:
    """How a lease's studies train (``run --study``): the trials' ``fit`` options, part of each study's identity; the
    pack a GPU trains them in, and the one pack it runs the study's last trials in once at most 5/4 of it are left
    (``None``: none); the file of their journal (one journal a setting: ``report`` and ``bootstrap`` compare gates
    trained alike); ``bench_precision.py``'s ``--variant`` that checks this arithmetic against float32's; and the
    preflight: the CUDA tests of the kernels (and captures) its trials launch that changed since a GPU last ran them,
    each with the name it checks (:mod:`mtmoe.plain_kernels`). ``--steps preflight,study`` runs them first, and the
    study trains with each kernel whose test did not pass run as its torch operations, each capture as eager
    dispatches (``MTMOE_PLAIN_KERNELS``: the same values, slower; the mixing's sums to rounding), so that no trial is
    trained by code the GPU computes wrongly (the dry run: skipped, no CUDA, the kernels kept). Empty a preflight once
    a lease's tests step passes its tests."""

    fit_args: tuple[str, ...]
    pack: int
    last_pack: int | None
    journal: str
    returned: str  # the journal's name, gzipped, as a lease returns it and docs/results/gpu-*/ keeps it
    variant: str
    preflight: dict[str, str]


# TF32 (the official code's arithmetic on Ampere and later GPUs), packs of 128, checkpoints kept on the device
# (device_paths). A trial interrupted at a lease's end reruns from its first epoch in the next lease (a pack's
# checkpoints, about 24 MiB a trial, cannot travel), so a lease keeps only the trials that finish inside it: packs
# small enough that a trial's 26 to 100 epochs end within one lease's study, rather than the pack ``--pack auto``
# finds fastest (all 500 at once, measured on an H200: none finished in a lease). With at most 320 trials left, one
# pack of 256: no trial waits for a slot, and the pack shrinks as they end (``benchmarks/lease_plan.py``: more of
# them complete in a lease than in packs of 128).
# bf16-mixed with the mixing's sums fused (``--model.fused_mixing_sums``: the experts' outputs never written; the
# configuration the roofline puts within 2x of its floor), all 500 trials in one pack: ``lease_plan.py`` models a
# lease of two calls completing them all at a pack epoch of ``1.24 + 0.0130 P`` s (the H200's fixed part, the part
# that grows with P shrunk as the roofline's projection of a trial-epoch), where packs of 256 complete some 462.
STUDY_SETTINGS = {
    "tf32": StudySetting(
        fit_args=("--model.matmul_precision=high",), pack=128, last_pack=256, journal=f"{DATASET}.journal",
        returned="study.journal.gz", variant="high", preflight={
            "tests/test_epilogue.py::test_cuda_equals_cpu[dtype0]": "epilogue",
            "tests/test_mixing.py::test_cuda_equals_cpu[dtype0]": "mixing",
            "tests/test_random.py::test_cuda_equals_cpu[dtype0]": "dropout",
            "tests/test_shared_input.py::test_cuda_equals_cpu[dtype0]": "shared_input",
            **{f"{EVAL_GRAPHS_TEST}[{gate}]": "eval_graphs" for gate in STUDY_GATES}}),
    "bf16-fused-sums": StudySetting(
        fit_args=("--trainer.precision=bf16-mixed", "--model.fused_mixing_sums=true"), pack=500, last_pack=None,
        journal=f"{DATASET}-bf16-fused-sums.journal", returned="study-bf16-fused-sums.journal.gz",
        variant="bf16-fused-sums", preflight={
            "tests/test_epilogue.py::test_cuda_equals_cpu[dtype2]": "epilogue",
            "tests/test_mixing_sums.py::test_cuda_equals_cpu[dtype1]": "mixing",
            "tests/test_random.py::test_cuda_equals_cpu[dtype2]": "dropout",
            "tests/test_shared_input.py::test_cuda_equals_cpu[dtype1]": "shared_input",
            "tests/test_comet_reach.py::test_cuda_equals_cpu[dtype1]": "reach",
            **{f"{EVAL_GRAPHS_TEST}[{gate}]": "eval_graphs" for gate in STUDY_GATES}}),
}
#: The setting of the study the leases so far trained (234 of comet's 500 trials after those of 2026-11-27)
DEFAULT_STUDY = "tf32"
# --steps chooses among them; install always runs
STEPS = ("tests", "bench", "precision", "preflight", "study", "report", "bootstrap")
KILL_GRACE = 5  # seconds from a step's SIGTERM to its SIGKILL; the study's clean stop has Sizes.stop
MIN_STEP = 15  # seconds: a step with less left of --total is skipped
SUMMARY_S = 10  # seconds of --total kept for the summary and the archives
OUT_OF_TIME = "s left of --total)"  # the end of the status of a step skipped for want of time


@dataclass(frozen=True)
class Sizes:
    """What a run trains and how long it may take (seconds): each step its budget, the study what is left of
    ``total`` once the steps after it have theirs."""

    packs: str
    trials: int
    bench_args: list[str]
    tune_args: list[str]
    bootstrap_args: list[str]
    budgets: dict[str, int] = field(default_factory=dict)  # seconds; "bench": each precision's
    total: int = 540
    stop: int = 30  # the study's SIGTERM comes this long before its budget ends
    drain: int = 10  # tune --timeout: no trial is claimed this long before the SIGTERM (one could not finish)
    pack: int | None = None  # the study's --pack whatever its setting's (the dry run's tiny studies)
    test_passes: str = "1,2"  # the bench's --test-pass: trials a test pass tests together
    trial_args: tuple[str, ...] = ()  # fit options of every trial of the bench and the precision check
    precision_args: tuple[str, ...] = ()  # bench_precision.py's options (the setting gives its --variant)


def study_args(sizes: Sizes, setting: StudySetting, complete: int) -> list[str]:
    """``tune``'s options for a study of ``setting`` with ``complete`` of its trials done: ``sizes.tune_args``, the
    setting's fit options and its ``--pack`` (``sizes.pack`` where given), its last pack once that holds nearly
    every trial left (``benchmarks/lease_plan.py`` models both)."""
    pack = sizes.pack or setting.pack
    if sizes.pack is None and setting.last_pack is not None and 4 * (sizes.trials - complete) <= 5 * setting.last_pack:
        pack = setting.last_pack
    return [*sizes.tune_args, *setting.fit_args, f"--pack={pack}"]


# The bench: packs of 1 and of 256, each timed by phase and profiled: a step of P = 1 is the part of every step that
# packing does not amortise (its kernels' fixed cost; lease_plan.py puts what does not grow with P at a quarter of a
# P = 128 epoch).
GPU = Sizes("1,256", 500, ["--device", "cuda"], ["--trainer.accelerator=gpu"], ["--device", "cuda"],
            {"install": 40, "tests": 180, "bench": 140, "precision": 150, "preflight": 90, "report": 30,
             "bootstrap": 30},
            drain=120,  # a trial's 26 epochs at least (33 the fewest seen), a pack of 128's about 4 s each (H200)
            test_passes="1,16,64", precision_args=("--device", "cuda"))
# the interpreter's pace: each program of a kernel costs milliseconds, each 1,024 parameters one Adam program
TINY = "--data.batch_size=8 --model.n_experts=4 --model.embedding_dim=4 --model.expert_units=8 --model.tower_units=8"
DRY = Sizes("2", 2, ["--limit-batches", "1", "--profile-steps", "1", "--adam-repeats", "3"],
            ["--trainer.max_epochs=1", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1",
             "--trainer.limit_test_batches=1", *TINY.split()], ["--draws", "20", "--confidence", "0.5"],
            {"install": 30, "tests": 120, "bench": 150, "precision": 60, "preflight": 60, "report": 60,
             "bootstrap": 60}, total=760,
            stop=10, pack=2, trial_args=tuple(TINY.split()),
            precision_args=("--trials", "2", "--epochs", "1", "--train-batches", "1", "--val-batches", "1"))


def trial_options(trial_args: tuple[str, ...]) -> list[str]:
    """``--trial-args`` of ``bench_packs.py`` and ``bench_precision.py`` for these fit options (none: nothing)."""
    return [f"--trial-args={' '.join(trial_args)}"] if trial_args else []


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# ---- here: gather what travels ---------------------------------------------------------------------------------------

def tree_bytes() -> int:
    """Bytes of what the device tool sends: tracked and untracked, not ignored files, and the carried folder."""
    listed = subprocess.run(["git", "ls-files", "-coz", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    files = [ROOT / name for name in listed if name] + [p for p in CARRIED.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files if p.is_file())


def tree_record(root: Path, paths: list[str]) -> dict:
    """What ``gather`` records of the code that travels: the tracked files (relative to ``root``) and one digest of
    their contents (a missing file counts as missing), so that the device can tell whether the tree it runs is the
    one the recorded commit names."""
    digest = hashlib.sha256()
    for name in paths:
        path = root / name
        digest.update(name.encode() + b"\0" + (hashlib.sha256(path.read_bytes()).digest() if path.is_file()
                                                else b"missing"))
    return {"files": paths, "digest": digest.hexdigest()}


def tree_matches(root: Path, record: dict) -> bool:
    """Whether the files ``record`` lists (:func:`tree_record`) hold in ``root`` what they held when recorded."""
    return tree_record(root, record["files"])["digest"] == record["digest"]


def study_journal(study_dir: Path, setting: str) -> Path:
    """The journal storage of the lease's studies (:data:`STUDY_GATES`) of ``setting`` in ``study_dir``
    (``.gpu/study`` on a lease)."""
    return study_dir / STUDY_SETTINGS[setting].journal


def device_paths(setting: str) -> tuple[Path, Path, Path]:
    """The checkpoints folder, the preflight's verdict and the journal that a lease's calls keep on the device for
    the studies of ``setting`` (:data:`ON_DEVICE`)."""
    return ON_DEVICE / "checkpoints" / setting, ON_DEVICE / f"preflight-{setting}.json", \
        ON_DEVICE / STUDY_SETTINGS[setting].journal


def study_name(gate: str) -> str:
    return f"{DATASET}/{gate}"  # tune's default name


def reserved_after(name: str, chosen: tuple[str, ...], budgets: dict[str, int]) -> int:
    """Seconds kept for the chosen steps that end a run (report, bootstrap) after step ``name``."""
    after = STEPS[STEPS.index(name) + 1:] if name in STEPS else ()
    return sum(budgets[later] + KILL_GRACE for later in ("report", "bootstrap") if later in after and later in chosen)


def lease_order(folder: str) -> tuple[str, int]:
    """A ``gpu-<date>[-N]`` folder's place among a lease's (:func:`keep` names them): by date, then N (none: 1),
    so that ``-10`` comes after ``-2``."""
    match = re.fullmatch(r"gpu-(\d{4}-\d{2}-\d{2})(?:-(\d+))?", folder)
    return (match.group(1), int(match.group(2) or 1)) if match else (folder, 1)


def newest_kept_journal(results: Path, setting: str) -> Path | None:
    """The newest lease's ``results/gpu-<date>[-N]/<the setting's returned journal>`` (:func:`lease_order`), or
    ``None``."""
    saved = sorted(results.glob(f"gpu-*/{STUDY_SETTINGS[setting].returned}"),
                   key=lambda path: lease_order(path.parent.name))
    return saved[-1] if saved else None


def adopt_newer_state(journal: Path, state: bytes) -> bool | None:
    """Write ``state``, a state of the study's journal kept elsewhere, over ``journal`` where that holds no journal
    or an older state of it (a journal only grows: an older state is a prefix of a newer one). True where written,
    False where ``journal`` holds ``state`` or a newer state already, ``None`` where neither holds the other (two
    studies): ``journal`` is left as it is."""
    here = journal.read_bytes() if journal.exists() else b""
    if here.startswith(state):
        return False
    if not state.startswith(here):
        return None
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_bytes(state)
    return True


def restore_study(study_dir: Path, results: Path, setting: str) -> Path | None:
    """The storage of ``setting``'s studies as the last lease left it: the newest committed ``results/gpu-<date>
    [-...]/<returned journal>`` unpacked into ``study_dir`` where that holds no journal or an older state of it (a
    journal only grows: an older one is a prefix of the newer), so that a lease resumes the study, never runs its
    trials again; a journal there that the committed one is a prefix of (a lease's own, not yet kept) stays. The
    journal restored, or ``None``; one error line where the two are no states of one study."""
    journal, saved = study_journal(study_dir, setting), newest_kept_journal(results, setting)
    if saved is None:
        return None
    with gzip.open(saved) as source:
        adopted = adopt_newer_state(journal, source.read())
    if adopted is None:
        fail(f"{journal} is not a state of the study in {saved} (neither holds the other): move it away, and "
             "gather again to resume from the committed one")
    return saved if adopted else None


def gather() -> None:
    """The wheels (Python 3.12, manylinux x86-64, no dependencies resolved: :data:`WHEELS` names them all, at the
    versions installed here) and the MovieLens-100K files into ``.gpu/``; the study's storage restored from the last
    lease's (:func:`restore_study`); the commit; the size that travels."""
    from importlib.metadata import version

    from mtmoe.code_version import git_describe
    from mtmoe.data.download import ensure_files, manifest_entry
    from mtmoe.data.layout import data_root

    shutil.rmtree(WHEELS_DIR, ignore_errors=True)
    WHEELS_DIR.mkdir(parents=True)
    pinned = [f"{name}=={version(name)}" for name in WHEELS]
    platforms = [a for n in (28, 27, 17) for a in ("--platform", f"manylinux_2_{n}_x86_64")]
    download = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d",
                               str(WHEELS_DIR), *pinned], capture_output=True, text=True)
    if download.returncode != 0:
        fail(f"pip download failed ({download.stderr.strip().splitlines()[-1:]}): check the network and {pinned}")
    ensure_files(data_root(), SOURCE, download=True)
    for relative in manifest_entry(SOURCE)["files"]:
        target = DATA_DIR / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_root() / relative, target)
    commit = git_describe(ROOT) or ""
    (CARRIED / "commit").write_text(commit + "\n")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    (CARRIED / "tree.json").write_text(json.dumps(tree_record(ROOT, sorted(filter(None, tracked.split("\0"))))))
    STUDY_DIR.mkdir(exist_ok=True)
    for setting in STUDY_SETTINGS:
        restored = restore_study(STUDY_DIR, ROOT / "docs" / "results", setting)
        if restored is not None:
            print(f"the {setting} studies resume from {restored.relative_to(ROOT)}")
    size = tree_bytes()
    print(f"gathered {len(list(WHEELS_DIR.glob('*.whl')))} wheels ({', '.join(pinned)}) and {SOURCE} into "
          f"{CARRIED}; commit {commit}; the working tree with .gpu/ is {size / 2**20:.1f} MiB of the "
          f"{TREE_LIMIT / 2**20:.0f} MiB the device tool sends")
    if size > TREE_LIMIT:
        fail(f"{size / 2**20:.1f} MiB would travel, over {TREE_LIMIT / 2**20:.0f} MiB: remove large untracked files")


# the files of a returned results.tar.gz that are committed, and their names under docs/results/gpu-<date>/
KEPT_RESULTS = {"results/report/report.md": "report.md", "results/report/importance.png": "importance.png",
                "results/bootstrap/bootstrap.md": "bootstrap.md", "results/bootstrap/bootstrap.png": "bootstrap.png"}


def keep(calls: list[Path], results: Path, day: str) -> Path:
    """A lease's returned folders (its device calls' ``files_at``, in order) into a new ``results/gpu-<day>``
    (``-2``, ``-3``... where that exists): each call's ``summary.json``, ``summary.md`` and ``logs.tar.gz`` as
    ``call<K>-*``; from the last ``results.tar.gz`` the report, the bootstrap's table and both figures
    (:data:`KEPT_RESULTS`); each study setting's last returned journal, which :func:`restore_study` unpacks for the
    next lease. The folder made."""
    if not calls:
        fail("keep needs the folders a lease's device calls returned (their files_at), in order")
    for call in calls:
        if not (call / "summary.json").is_file():
            fail(f"{call} has no summary.json: give the folders the device calls returned (files_at)")
    name, number = f"gpu-{day}", 2
    while (results / name).exists():
        name, number = f"gpu-{day}-{number}", number + 1
    folder = results / name
    folder.mkdir(parents=True)
    for index, call in enumerate(calls, 1):
        for file in ("summary.json", "summary.md", "logs.tar.gz"):
            if (call / file).is_file():
                shutil.copyfile(call / file, folder / f"call{index}-{file}")
    archives = [call / "results.tar.gz" for call in calls if (call / "results.tar.gz").is_file()]
    if archives:
        with tarfile.open(archives[-1]) as archive:
            for member in archive.getmembers():
                if member.name in KEPT_RESULTS:
                    (folder / KEPT_RESULTS[member.name]).write_bytes(archive.extractfile(member).read())
    for returned in {setting.returned for setting in STUDY_SETTINGS.values()}:
        journals = [call / returned for call in calls if (call / returned).is_file()]
        if journals:
            shutil.copyfile(journals[-1], folder / returned)
    return folder


# ---- there: run the steps ----------------------------------------------------------------------------------------

@dataclass
class Step:
    name: str
    status: str  # ok, failed (exit code N), stopped at its budget, skipped (why)
    seconds: float
    budget: int
    output: str = ""
    cpu_seconds: float = 0.0  # user + system CPU of the step's processes: its time on an idle machine, about


def run_step(name: str, command: list[str], budget: int, logs: Path, env: dict, grace: int,
             stop_early: int = 0) -> Step:
    """``command`` in its own process group, its output in ``logs/<name>.log``; SIGTERM ``stop_early`` seconds
    before the budget (a clean stop), SIGKILL ``grace`` seconds later."""
    log = logs / f"{name}.log"
    start, cpu = time.perf_counter(), children_cpu()
    with open(log, "w") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=max(1, budget - stop_early))
            status = "ok" if code == 0 else f"failed (exit code {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                code = process.wait(timeout=grace)
                status = f"stopped at its budget (SIGTERM, exit code {code})"
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                status = "killed at its budget"
    seconds, cpu = time.perf_counter() - start, children_cpu() - cpu
    print(f"step {name}: {status}, {seconds:.0f} s of {budget} s (CPU {cpu:.0f} s)", flush=True)
    return Step(name, status, seconds, budget, log.read_text(errors="replace"), cpu)


def children_cpu() -> float:
    """User and system CPU seconds of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def environment(dry_run: bool) -> dict:
    """GPU, driver, torch, Triton (in use and supported), commit."""
    import torch

    from mtmoe.code_version import git_describe
    from mtmoe.triton_support import SUPPORTED_VERSIONS, triton

    found = {"torch": torch.__version__, "triton": getattr(triton, "__version__", None),
             "supported_versions": SUPPORTED_VERSIONS, "python": sys.version.split()[0], "dry_run": dry_run}
    if torch.cuda.is_available():
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
        found |= {"device": torch.cuda.get_device_name(), "nvidia_smi": smi, "cuda": torch.version.cuda}
    else:
        found["device"] = "cpu (no CUDA device)"
    gathered, tree = CARRIED / "commit", CARRIED / "tree.json"
    # the device tool sends the working tree as it is but git's metadata as it was when the session began: the
    # commit ``gather`` recorded names the code (run gather after the last commit); git's is kept beside it. A tree
    # changed since that gather is not that commit's: its results say so (the commit marked, a note printed)
    found["git_describe"] = git_describe(ROOT)
    found["commit"] = gathered.read_text().strip() if gathered.exists() and not dry_run else found["git_describe"]
    if gathered.exists() and tree.exists() and not dry_run:
        found["tree_as_gathered"] = tree_matches(ROOT, json.loads(tree.read_text()))
        if not found["tree_as_gathered"]:
            found["commit"] += "+changed-since-gather"
            print(f"note: the tracked files differ from those gather recorded with {gathered.read_text().strip()}: "
                  f"this run's results name the code {found['commit']} (run gather after the last commit)",
                  flush=True)
    return found


def tests_summary(output: str) -> dict:
    """pytest's counts from its last summary line."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                                     lines[-1] if lines else "")}
    return {"line": lines[-1].strip("= ") if lines else "", **counts}


def passed_tests(output: str) -> set[str]:
    """The tests ``pytest -v`` says passed, each as it finishes (a run stopped at its budget keeps those before)."""
    return set(re.findall(r"^(\S+::\S+) PASSED", output, re.MULTILINE))


def throughput(output: str, precision: str) -> list[dict]:
    """bench_packs.py's table rows (``| gate | P | graphs | Adam | epoch (s) | trial-epochs / hour | ...``), each
    with ``phases_s``, where its epoch's seconds went (its ``phases`` line, in the order of the rows)."""
    rows = []
    for cells in (line.strip("|").split("|") for line in output.splitlines() if line.startswith("| ")):
        cells = [c.strip() for c in cells]
        if len(cells) >= 6 and cells[1].isdigit():
            rows.append({"precision": precision, "gate": cells[0], "P": int(cells[1]), "graphs": cells[2],
                         "epoch_s": float(cells[4]), "trial_epochs_per_hour": int(cells[5].replace(",", "")),
                         "memory_per_trial_mib": cells[7] if len(cells) > 7 else ""})
    for row, phases in zip(rows, key_value_lines(output, "phases")):
        row["phases_s"] = {key.removesuffix("_s"): value for key, value in phases.items() if key.endswith("_s")}
        row["train_steps"], row["val_batches"] = int(phases["train_steps"]), int(phases["val_batches"])
        row["val_eager_s"] = phases["val_eager"]
    return rows


def key_value_lines(output: str, kind: str) -> list[dict]:
    """bench_packs.py's ``KIND key=value ...`` lines (``profile``: ``--profile``'s; ``phases``: where a pack epoch's
    time went), numbers as numbers."""
    found = []
    for line in output.splitlines():
        if line.startswith(f"{kind} "):
            pairs = dict(field.split("=", 1) for field in line.split()[1:])
            found.append({key: float(value) if re.fullmatch(r"[\d.]+", value) else value
                          for key, value in pairs.items()})
    return found


STUDY_STATE = """
import json, sys, optuna
storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(sys.argv[1]))
states = {}
for name in optuna.get_all_study_names(storage):
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    evaluated = {t.user_attrs.get("config_id") for t in complete + [t for t in failed if "fail_reason" in t.user_attrs]}
    epochs = [t.user_attrs["epochs_run"] for t in complete if t.user_attrs.get("epochs_run") is not None]
    states[name] = {"trials": len(trials), "trials_complete": len(complete), "trials_failed": len(failed),
                    "configurations_evaluated": len(evaluated),
                    "mean_epochs": sum(epochs) / len(epochs) if epochs else None,
                    "trial_epochs": sum(len(t.intermediate_values) for t in trials)}
print(json.dumps(states))
"""
#: A study the journal does not hold yet.
NO_STUDY = {"trials": 0, "trials_complete": 0, "trials_failed": 0, "configurations_evaluated": 0, "mean_epochs": None,
            "trial_epochs": 0}


def study_states(journal: Path, env: dict) -> dict[str, dict]:
    """Each study of ``journal`` by name: its trials, complete and failed ones, configurations evaluated (complete
    or failed with a reason), mean epochs and trial-epochs; ``{"error": ...}`` where the journal cannot be read."""
    if not journal.exists():
        return {}
    result = subprocess.run([sys.executable, "-c", STUDY_STATE, str(journal)], capture_output=True, text=True,
                            env=env, timeout=120)
    return json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr.strip()[-500:]}


def next_study(states: dict[str, dict], trials: int) -> str | None:
    """The gate of :data:`STUDY_GATES` whose study is the first with fewer than ``trials`` configurations
    evaluated (``None``: all are done)."""
    return next((gate for gate in STUDY_GATES
                 if states.get(study_name(gate), NO_STUDY).get("configurations_evaluated", 0) < trials), None)


def read_verdict(path: Path | None, commit: str) -> list[str] | None:
    """The names a preflight of ``commit`` on this machine did not pass, as ``path`` keeps them (``None``: no such
    preflight)."""
    try:
        verdict = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    return verdict["plain"] if isinstance(verdict, dict) and verdict.get("commit") == commit else None


def run(out: Path, sizes: Sizes, study_dir: Path, dry_run: bool = False, chosen: tuple[str, ...] = STEPS,
        precisions: tuple[str, ...] = GPU_PRECISIONS, checkpoint_dir: Path | None = None,
        verdict_file: Path | None = None, device_journal: Path | None = None, setting: str = DEFAULT_STUDY) -> dict:
    """The ``chosen`` steps, their logs and the summary in ``out`` (see the module's docstring), the studies, the
    preflight and the precision check those of ``setting`` (:data:`STUDY_SETTINGS`); the study's checkpoints in
    ``checkpoint_dir`` (``tune --checkpoint-dir``; default: beside its journal); the preflight's verdict in
    ``verdict_file``, for a later call's study (the study never trains kernels this machine has not checked: without
    the preflight in ``chosen`` it takes the verdict there, and without one it runs the preflight first); the study's
    journal kept in ``device_journal`` after the study, and read from there where it is newer than ``study_dir``'s
    (:func:`adopt_newer_state`: a lease's second call resumes where its first stopped, whatever journal it carried);
    returns the summary."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    logs = scratch / "logs"
    logs.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    if DATA_DIR.is_dir() and not dry_run:
        env["MTMOE_DATA"] = str(DATA_DIR)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
        blocker = scratch / "absent"  # a sitecustomize, imported at every start-up, before the steps' imports
        blocker.mkdir()
        (blocker / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({ABSENT_ON_GPU!r}))\n")
        env["PYTHONPATH"] = f"{blocker}{os.pathsep}{ROOT}"
    python = sys.executable
    summary = {"environment": environment(dry_run)}
    summary["device"], summary["commit"] = summary["environment"]["device"], summary["environment"]["commit"]
    if summary["commit"]:  # what each trial records as the code that trained it (git's history here may be stale)
        from mtmoe.code_version import ENVIRONMENT as CODE

        env[CODE] = summary["commit"]
    print(json.dumps(summary["environment"]), flush=True)
    study_setting = STUDY_SETTINGS[setting]
    summary["setting"] = setting
    verdict = read_verdict(verdict_file, summary["commit"])
    if "study" in chosen and "preflight" not in chosen and study_setting.preflight and verdict is None \
            and not dry_run:
        chosen = (*chosen, "preflight")  # no verdict on this machine for this commit: the preflight first
    steps: list[Step] = []
    budgets = sizes.budgets

    def step(name: str, command: list[str], budget: int, grace: int = KILL_GRACE, stop_early: int = 0) -> Step:
        kind = name.split("-")[0]
        left = int(sizes.total - (time.perf_counter() - start) - reserved_after(kind, chosen, budgets) - SUMMARY_S)
        if kind not in chosen + ("install",):
            steps.append(Step(name, "skipped (not in --steps)", 0, budget))
        elif left < MIN_STEP:
            steps.append(Step(name, f"skipped ({max(left, 0)} {OUT_OF_TIME}", 0, budget))
        else:  # no step outlasts --total: the device call's limit would kill the run before its summary
            steps.append(run_step(name, command, min(budget, left), logs, env, grace, stop_early))
        return steps[-1]

    wheels = sorted(WHEELS_DIR.glob("*.whl"))
    if wheels:
        site = scratch / "site"
        step("install", [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                         "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], budgets["install"])
        env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    else:
        steps.append(Step("install", "skipped (no wheels in .gpu/wheels: run gather)", 0, budgets["install"]))
    # addopts emptied: the CUDA tests in this one process, not pyproject's worker per core (each its own CUDA
    # context), and without pytest-xdist, which the GPU image lacks
    tests = step("tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE",
                           "--durations=10", *CUDA_TESTS],
                 budgets["tests"])
    summary["tests"] = tests_summary(tests.output)
    rows, profiles, test_passes = [], [], []
    for precision in precisions:
        options, fit_options = PRECISIONS[precision]
        trial_args = (*sizes.trial_args, *fit_options)
        bench = step(f"bench-{precision}", [python, "benchmarks/bench_packs.py", "--gates", GATE, "--packs",
                                            sizes.packs, "--graphs", "on", "--profile-epoch",
                                            "--profile", sizes.packs, "--test-pass", sizes.test_passes,
                                            "--out", str(scratch / f"bench-{precision}"),
                                            *options, *sizes.bench_args,
                                            *trial_options(trial_args)],
                     budgets["bench"])
        rows += throughput(bench.output, precision)
        profiles += [{**line, "precision": precision} for line in key_value_lines(bench.output, "profile")]
        test_passes += [{**line, "precision": precision} for line in key_value_lines(bench.output, "test-pass")]
    summary["throughput"], summary["profile"], summary["test_pass"] = rows, profiles, test_passes
    step("precision", [python, "benchmarks/bench_precision.py", *sizes.precision_args, "--variant",
                       study_setting.variant, *trial_options(sizes.trial_args), "--out", str(scratch / "precision")],
         budgets["precision"])
    summary["precision"] = precision_summary(scratch / "precision" / "precision.json")
    preflight = step("preflight", [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=",
                                   *study_setting.preflight], budgets["preflight"]) if study_setting.preflight else None
    summary["preflight"] = tests_summary(preflight.output) if preflight is not None else {}
    if preflight is None or dry_run:
        plain = []
    elif preflight.status == "skipped (not in --steps)":
        plain = verdict or []  # an earlier call's preflight on this machine
    else:  # the names whose tests did not pass (none passed in a preflight skipped for want of time)
        plain = sorted({kernel for test, kernel in study_setting.preflight.items()
                        if test not in passed_tests(preflight.output)})
        if verdict_file is not None and not preflight.status.startswith("skipped"):
            verdict_file.parent.mkdir(parents=True, exist_ok=True)
            verdict_file.write_text(json.dumps({"commit": summary["commit"], "plain": plain}))  # torn: no verdict
    study_dir.mkdir(parents=True, exist_ok=True)
    journal = study_journal(study_dir, setting)
    storage = f"journal:{journal}"
    journal_from = "carried" if journal.exists() else "none"
    if device_journal is not None and device_journal.exists():  # an earlier call of this lease, on this machine
        adopted = adopt_newer_state(journal, device_journal.read_bytes())
        journal_from = "device" if adopted else journal_from
        if adopted is None:
            print(f"note: {device_journal} is another study's journal than {journal}: the run resumes the carried one",
                  flush=True)
    states = study_states(journal, env)
    gate = next_study(states, sizes.trials) if "error" not in states else STUDY_GATES[0]
    name = study_name(gate or STUDY_GATES[-1])  # the study trained, or (all complete) the last
    before = states.get(name, NO_STUDY)
    study_budget = int(sizes.total - (time.perf_counter() - start) - reserved_after("study", chosen, budgets)
                       - SUMMARY_S)
    timeout = max(1, study_budget - sizes.stop - sizes.drain)  # the trials claimed later could not finish
    tune_args = study_args(sizes, study_setting, before.get("trials_complete") or 0)
    from mtmoe.plain_kernels import ENVIRONMENT

    if plain:  # the kernels whose test failed or did not run: the study trains without them
        env[ENVIRONMENT] = ",".join(plain)
    if gate is None:
        tune = Step("study", f"skipped (the studies of {', '.join(STUDY_GATES)} are complete)", 0, study_budget)
        steps.append(tune)
    else:
        tune = step("study", [python, "-m", "mtmoe", "tune", "--gate", gate, "--data", DATASET, "--trials",
                              str(sizes.trials), "--storage", storage, "--log-dir", str(scratch / "runs"),
                              "--timeout", str(timeout), *tune_args,
                              *(["--checkpoint-dir", str(checkpoint_dir)] if checkpoint_dir else [])],
                    study_budget, sizes.stop,
                    stop_early=sizes.stop)
    env.pop(ENVIRONMENT, None)
    if device_journal is not None and journal.exists():  # for the lease's next call: written whole, then renamed
        device_journal.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(journal, device_journal.with_suffix(".partial"))
        os.replace(device_journal.with_suffix(".partial"), device_journal)
    states = study_states(journal, env)
    after = states.get(name, states if "error" in states else NO_STUDY)
    trained = (after.get("trial_epochs") or 0) - (before.get("trial_epochs") or 0)  # interrupted trials' included
    summary["studies"] = states
    summary["study"] = {"name": name, "journal": str(journal), "journal_from": journal_from, "target": sizes.trials,
                        "before": before, **after,
                        "wall_s": tune.seconds,
                        "status": tune.status, "timeout_s": timeout, "plain_kernels": plain,
                        "pack": next((a.split("=", 1)[1] for a in tune_args if a.startswith("--pack=")), None),
                        "trial_epochs_per_hour": round(trained / tune.seconds * 3600) if tune.seconds else None}
    summary["trials_complete"], summary["wall_s"] = after.get("trials_complete"), tune.seconds
    summary["study"]["checkpoints"] = return_checkpoints(checkpoint_dir or study_dir / "checkpoints", out)
    summary["study"]["epochs"] = pack_epochs(scratch / "runs", logs)
    results = scratch / "results"
    step("report", [python, "-m", "mtmoe", "report", "--data", DATASET, "--storage", storage, "--out",
                    str(results / "report")], budgets["report"])
    step("bootstrap", [python, "-m", "mtmoe", "bootstrap", "--data", DATASET, "--storage", storage, "--out",
                       str(results / "bootstrap"), *sizes.bootstrap_args], budgets["bootstrap"])
    summary["steps"] = {s.name: {"status": s.status, "seconds": round(s.seconds, 1), "budget_s": s.budget,
                                 "cpu_s": round(s.cpu_seconds, 1)} for s in steps}
    summary["total_s"] = round(time.perf_counter() - start, 1)
    summary["cpu_s"], summary["load_average"] = round(sum(s.cpu_seconds for s in steps), 1), os.getloadavg()
    table = short_table(summary)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as archive:
        archive.add(logs, "logs")
    if results.exists():
        with tarfile.open(out / "results.tar.gz", "w:gz") as archive:
            archive.add(results, "results")
        for report in results.rglob("report.md"):
            shutil.copyfile(report, out / "report.md")
    if journal.exists():
        (out / study_setting.returned).write_bytes(gzip.compress(journal.read_bytes(), compresslevel=9))
    shutil.rmtree(scratch, ignore_errors=True)
    print(table, flush=True)
    return summary


def return_checkpoints(folder: Path, out: Path) -> dict:
    """The study's pack checkpoints (in ``folder``) as ``out/checkpoints.tar.gz`` (paths relative to it), unless
    they are over :data:`RETURN_LIMIT` (float32 tensors barely compress): then they stay on the machine, where the
    next call of the same lease resumes from them. What was found and done."""
    files = sorted(folder.rglob("*.pt"))
    found = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    found["returned"] = 0 < found["bytes"] <= RETURN_LIMIT
    if found["returned"]:
        with tarfile.open(out / "checkpoints.tar.gz", "w:gz") as tar:
            for path in files:
                tar.add(path, str(path.relative_to(folder)))
    return found


def pack_epochs(runs: Path, logs: Path) -> dict:
    """Where the study's pack epochs spent their wall time (``tune``'s ``pack-epochs.csv``, copied into ``logs``):
    the epochs, the trial-epochs and ended trials in them, and each part's seconds summed."""
    import csv

    found = sorted(runs.glob("*/pack-epochs.csv"))
    if not found:
        return {}
    shutil.copyfile(found[0], logs / "pack-epochs.csv")
    with open(found[0]) as file:
        rows = list(csv.DictReader(file))
    sums = {key: round(sum(float(row[key]) for row in rows), 2)
            for key in rows[0] if key in ("trained", "ended", "tested") or key.endswith("_s")} if rows else {}
    return {"pack_epochs": len(rows), **sums}


def precision_summary(path: Path) -> dict:
    """What ``bench_precision.py`` found (its ``precision.json`` without the objectives), or ``{}`` where it wrote
    nothing."""
    if not path.exists():
        return {}
    found = json.loads(path.read_text())
    return {key: found[key] for key in ("configurations", "variant_max", "variant_median", "spearman_variant",
                                        "seed_max", "seed_median", "spearman_seeds", "configs_std", "seconds")}


def short_table(summary: dict) -> str:
    study, tests = summary["study"], summary["tests"]
    lines = [f"gpu-check on {summary['device']}, commit {summary['commit']}, torch {summary['environment']['torch']}, "
             f"Triton {summary['environment']['triton']}", "", "| step | status | seconds / budget |", "|---|---|---|"]
    lines += [f"| {name} | {s['status']} | {s['seconds']:.0f} / {s['budget_s']} |"
              for name, s in summary["steps"].items()]
    lines += ["", f"tests: {tests.get('line') or 'no summary line'}"]
    if summary.get("preflight"):
        lines += [f"preflight: {summary['preflight'].get('line') or 'no summary line'}"]
    found = summary.get("precision")
    if found:
        lines += [f"precision: {found['configurations']} configurations, float32 against {summary['setting']} (same "
                  f"seeds) at most "
                  f"{found['variant_max']:.2e} apart (median {found['variant_median']:.2e}, Spearman "
                  f"{found['spearman_variant']:.4f}); two seeds in float32 at most {found['seed_max']:.2e} (Spearman "
                  f"{found['spearman_seeds']:.4f}); the configurations' standard deviation {found['configs_std']:.2e}"]
    lines += ["",
              "| precision | gate | P | epoch (s) | trial-epochs / hour | between / train / val / end (s) "
              "| train step (ms) | val, eager (s) |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['gate']} | {r['P']} | {r['epoch_s']:.2f} | {r['trial_epochs_per_hour']:,} | "
              + " / ".join(f"{seconds:.2f}" for seconds in r.get("phases_s", {}).values())
              + (f" | {1000 * r['phases_s']['train'] / r['train_steps']:.2f} |" if r.get("train_steps") else " | |")
              + (f" {r['val_eager_s']:.2f} |" if "val_eager_s" in r else " |")
              for r in summary["throughput"]]
    lines += ["", "| precision | P | eager step (ms) | kernels' time (ms) | kernels |", "|---|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['P']:.0f} | {r['step_ms']:.2f} | {r.get('kernel_ms', 'n/a')} | "
              f"{r.get('kernels', 'n/a')} |" for r in summary["profile"]]
    mean_epochs = study.get("mean_epochs")
    lines += ["", f"study {study.get('name')}: {study.get('trials_complete')} of its {study.get('target')} trials "
                  f"complete ({study['before'].get('trials_complete')} before this run; {study.get('trials_failed')} "
                  f"attempts failed or interrupted, run again by the next run), mean epochs "
                  f"{'n/a' if mean_epochs is None else f'{mean_epochs:.1f}'}, {study['wall_s']:.0f} s this run "
                  f"({study['status']}) in packs of {study.get('pack')}, "
                  f"{study.get('trial_epochs_per_hour')} trial-epochs per hour (set-up included)"]
    others = {name: state for name, state in summary.get("studies", {}).items()
              if name != study.get("name") and isinstance(state, dict)}
    if others:
        lines += ["the journal's other studies: " + "; ".join(
            f"{name} {state.get('configurations_evaluated')} of {study.get('target')} configurations evaluated"
            for name, state in others.items())]
    if study.get("journal_from") == "device":
        lines += ["the study resumed from the journal this machine kept (the lease's earlier call), newer than the "
                  "carried one"]
    if study.get("plain_kernels"):
        lines += [f"the preflight did not pass the kernels {', '.join(study['plain_kernels'])}: the study trained "
                  "them as torch operations, captures eagerly (MTMOE_PLAIN_KERNELS)"]
    epochs = study.get("epochs") or {}
    if epochs:
        lines += [f"study's {epochs['pack_epochs']} pack epochs ({epochs['trained']:.0f} trial-epochs, "
                  f"{epochs['ended']:.0f} trials ended): " + ", ".join(f"{key} {value:.1f}" for key, value in
                                                                   epochs.items() if key.endswith("_s"))]
    saved = study.get("checkpoints", {})
    if saved.get("files"):
        lines += [f"checkpoints: {saved['files']} file(s), {saved['bytes'] / 2**20:.1f} MiB, " +
                  ("returned as checkpoints.tar.gz" if saved["returned"] else
                   f"not returned (over the {RETURN_LIMIT / 2**20:.0f} MiB a returned file may have): they stay "
                   "on this machine for the next call of this lease")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=["gather", "run", "keep"],
                        help="gather (here), run (on the GPU), keep (here: what a lease returned into docs/results)")
    parser.add_argument("calls", nargs="*", type=Path, help="keep: the folders the lease's device calls returned")
    parser.add_argument("--out", type=Path, help="run: the output folder ($OUT on the device)")
    parser.add_argument("--dry-run", action="store_true", help="the run's steps on this CPU, tiny, under 90 s")
    parser.add_argument("--total", type=int, help=f"run: seconds for all the steps (default {GPU.total}; less when "
                        "the lease has less left): the study gets what the others leave")
    parser.add_argument("--precisions", help=f"bench_packs.py's precisions, of {','.join(PRECISIONS)} (default: "
                        f"{','.join(GPU_PRECISIONS)}, what a lease runs, in the dry run too; fp32 at P = 256 needs "
                        "more than a minute on the GPU)")
    parser.add_argument("--drain", type=int, default=None, help=f"run: tune claims no trial this long before the "
                        f"study's stop, seconds (default {GPU.drain}: the trials in flight finish; 0 where the next "
                        "call of the lease continues them from their checkpoints)")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"run: the steps to run, of {','.join(STEPS)} (a resumed study: study,report,bootstrap)")
    parser.add_argument("--study", default=DEFAULT_STUDY, help=f"run: how the studies train, of "
                        f"{','.join(STUDY_SETTINGS)} (default {DEFAULT_STUDY}); each setting has its own journal, "
                        "preflight and precision check")
    args = parser.parse_args()
    chosen = tuple(args.steps.split(","))
    precisions = tuple(args.precisions.split(",")) if args.precisions else GPU_PRECISIONS
    if not set(chosen) <= set(STEPS):
        fail(f"--steps {args.steps}: choose among {','.join(STEPS)}")
    if not set(precisions) <= set(PRECISIONS):
        fail(f"--precisions {args.precisions}: choose among {','.join(PRECISIONS)}")
    if args.study not in STUDY_SETTINGS:
        fail(f"--study {args.study}: choose among {','.join(STUDY_SETTINGS)}")
    if args.drain is not None and args.drain < 0:
        fail(f"--drain must be a number of seconds >= 0, got {args.drain}")
    if args.total is not None and args.total <= 0:
        fail(f"--total must be a positive number of seconds, got {args.total}")
    if args.command == "gather":
        gather()
    elif args.command == "keep":
        folder = keep(args.calls, ROOT / "docs" / "results", time.strftime("%Y-%m-%d", time.gmtime()))
        print(f"kept in {folder.relative_to(ROOT)}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
    elif args.dry_run:
        out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-dry-"))
        study = Path(tempfile.mkdtemp(prefix="gpu-check-study-"))
        summary = run(out, DRY, study, dry_run=True, chosen=chosen, precisions=precisions,
                      checkpoint_dir=study / "device-checkpoints", setting=args.study)
        shutil.rmtree(study)
        # a step skipped for want of time is broken here (the dry run's sizes leave plenty); one left out by
        # --steps, or the install without gathered wheels (CI has none), is not
        broken = {name: s["status"] for name, s in summary["steps"].items()
                  if s["status"] != "ok" and not (s["status"].startswith("skipped")
                                                 and not s["status"].endswith(OUT_OF_TIME))}
        if broken or not summary["throughput"] or not summary["trials_complete"]:
            fail(f"dry run: steps {broken}, {len(summary['throughput'])} throughput rows, "
                 f"{summary['trials_complete']} trials complete; the logs are in {out / 'logs.tar.gz'}")
        print(f"gpu-check dry-run ok: {len(summary['steps'])} steps in {summary['total_s']:.0f} s "
              f"({summary['cpu_s']:.0f} s of CPU; load average {summary['load_average'][0]:.1f}), output in {out}")
    elif args.command == "run":
        if args.out is None:
            fail("run needs --out DIR (on the device: --out $OUT)")
        sizes = replace(GPU, total=args.total or GPU.total, drain=GPU.drain if args.drain is None else args.drain)
        checkpoints, verdict, journal = device_paths(args.study)
        run(args.out, sizes, STUDY_DIR, chosen=chosen, precisions=precisions, checkpoint_dir=checkpoints,
            verdict_file=verdict, device_journal=journal, setting=args.study)
    else:
        fail("give a command: gather, run --out DIR, or --dry-run")


if __name__ == "__main__":
    main()
