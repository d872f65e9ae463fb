"""``benchmarks/gpu_check.py``: the lent GPU's one command, run here as ``--dry-run`` (the same steps, tiny, on the
CPU, Triton's interpreter), so that the GPU path cannot rot between leases."""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import optuna
import pytest

from conftest import require_dataset

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_check  # noqa: E402


def test_run_without_an_output_folder_is_one_error_line() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "run"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: run needs --out DIR (on the device: --out $OUT)"]


@pytest.mark.integration
def test_a_step_past_its_budget_is_stopped_and_reported(tmp_path: Path) -> None:
    """SIGTERM at the budget; a process that ignores it is killed ``grace`` seconds later: the next step runs."""
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('started', flush=True); " \
             "time.sleep(60)"
    step = gpu_check.run_step("stubborn", [sys.executable, "-c", ignore], 3, tmp_path, dict(os.environ), grace=1)
    assert step.status == "killed at its budget" and step.seconds < 10
    assert "started" in step.output
    step = gpu_check.run_step("polite", [sys.executable, "-c", "import time; time.sleep(60)"], 3, tmp_path,
                              dict(os.environ), grace=5)
    assert step.status.startswith("stopped at its budget") and step.seconds < 10


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_the_dry_run_runs_every_step_and_writes_the_summary(tmp_path: Path) -> None:
    require_dataset("movielens-100k")
    # the precisions a lease runs (fp32's bench_packs.py options are tf32's without the matmul precision)
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--precisions",
                             ",".join(gpu_check.GPU_PRECISIONS)], cwd=ROOT, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("gpu-check dry-run ok")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trials_complete"] == gpu_check.DRY.trials and summary["wall_s"] > 0
    assert summary["study"]["trial_epochs_per_hour"] > 0  # from the trial-epochs the journal gained
    trials = gpu_check.DRY.trials  # of the study's target, not of every attempt in the storage
    assert f"study movielens-100k/comet: {trials} of its {trials} trials complete (0 before this run; 0 attempts " \
        "failed" in (tmp_path / "summary.md").read_text()
    assert summary["study"]["pack"] == "2" and "in packs of 2," in (tmp_path / "summary.md").read_text()
    epochs = summary["study"]["epochs"]  # tune's pack-epochs.csv, summed: every trial-epoch, every ended trial
    assert epochs["trained"] == trials and epochs["ended"] == trials and epochs["train_val_s"] > 0
    assert f"study's {epochs['pack_epochs']} pack epochs ({trials} trial-epochs, {trials} trials ended)" in \
        (tmp_path / "summary.md").read_text()
    with tarfile.open(tmp_path / "logs.tar.gz") as archive:
        assert "logs/pack-epochs.csv" in archive.getnames()
    assert summary["device"] and summary["commit"] and summary["tests"]["line"]
    assert {row["precision"] for row in summary["throughput"]} == set(gpu_check.GPU_PRECISIONS)
    assert {row["precision"] for row in summary["profile"]} == set(gpu_check.GPU_PRECISIONS)
    assert all(row["step_ms"] > 0 and row["P"] == int(gpu_check.DRY.packs) for row in summary["profile"])
    assert sorted((row["precision"], row["K"]) for row in summary["test_pass"]) == sorted(
        (precision, k) for precision in gpu_check.GPU_PRECISIONS for k in (1.0, 2.0))
    assert all(row["ms"] > 0 and row["batches"] == 1 for row in summary["test_pass"])  # --limit-batches 1
    assert summary["precision"]["configurations"] == 2 and summary["precision"]["seed_max"] >= 0
    assert "precision: 2 configurations, float32 against tf32 (same seeds)" in (tmp_path / "summary.md").read_text()
    for row in summary["throughput"]:  # the epoch's phases sum to it (bench_packs.py's rounding to 0.01 s)
        assert set(row["phases_s"]) == {"between", "train", "val", "end"}
        assert row["train_steps"] == row["val_batches"] == 1  # --limit-batches 1
        assert row["val_eager_s"] > 0  # the third epoch's validation, before its batches' capture
        assert all(s >= 0 for s in row["phases_s"].values())
        assert sum(row["phases_s"].values()) == pytest.approx(row["epoch_s"], abs=0.01)
    install = summary["steps"].pop("install")["status"]  # CI has no gathered wheels; this VM may
    assert install in ("ok", "skipped (no wheels in .gpu/wheels: run gather)"), install
    assert all(s["status"] == "ok" for s in summary["steps"].values()), summary["steps"]
    returned = sorted(p.name for p in tmp_path.iterdir())
    expected = {"summary.json", "summary.md", "logs.tar.gz", "study.journal.gz", "report.md", "results.tar.gz"}
    assert expected <= set(returned)
    assert len(returned) <= 8 and all(p.is_file() for p in tmp_path.iterdir())  # the device tool returns 8 files
    journal = tmp_path / "unpacked.journal"  # the returned journal is the study's: what resumes it
    journal.write_bytes(gzip.decompress((tmp_path / "study.journal.gz").read_bytes()))
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    (name,) = optuna.get_all_study_names(storage)
    states = [t.state for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)]
    assert states.count(optuna.trial.TrialState.COMPLETE) == trials


@pytest.mark.integration  # a pytest process
def test_every_test_a_lease_names_exists() -> None:
    """The CUDA tests and each setting's preflight tests are named by node id; one that pytest cannot find would
    fail only on a lease (a preflight that finds none trains every kernel as torch operations)."""
    preflight = sorted({test for setting in gpu_check.STUDY_SETTINGS.values() for test in setting.preflight})
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-o",
                             "addopts=", *gpu_check.CUDA_TESTS, *preflight], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = set(result.stdout.split())
    assert set(preflight) <= collected, set(preflight) - collected


@pytest.mark.integration  # a tune process
def test_the_next_lease_resumes_the_kept_study_it_names(tmp_path: Path) -> None:
    """The TF32 study the leases train resumes with this code: ``tune`` with the options ``gpu_check`` gives it (the
    accelerator and the pack, not part of a study's identity, made the CPU's) on a copy of the newest kept journal accepts the
    study's identity (search space, seed, settings) and finds its trials, where a changed space or setting would
    refuse it and cost the lease. ``--timeout 1``: it claims nothing."""
    require_dataset("movielens-100k")
    kept = gpu_check.newest_kept_journal(ROOT / "docs" / "results", gpu_check.DEFAULT_STUDY)
    journal = tmp_path / "study.journal"
    journal.write_bytes(gzip.decompress(kept.read_bytes()))
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    study = optuna.load_study(study_name=gpu_check.study_name(gpu_check.GATE), storage=storage)
    complete = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.get_trials(deepcopy=False))
    options = gpu_check.study_args(gpu_check.GPU, gpu_check.STUDY_SETTINGS[gpu_check.DEFAULT_STUDY], complete)
    # neither the accelerator nor the pack is part of a study's identity: the CPU's, and a pack this CPU's free
    # memory always holds (tune refuses a pack that does not fit)
    options = ["--pack=1" if option.startswith("--pack=") else option.replace("accelerator=gpu", "accelerator=cpu")
               for option in options]
    result = subprocess.run([sys.executable, "-m", "mtmoe", "tune", "--gate", gpu_check.GATE, "--data",
                             gpu_check.DATASET, "--trials", str(gpu_check.GPU.trials), "--storage", f"journal:{journal}",
                             "--log-dir", str(tmp_path / "runs"), "--checkpoint-dir", str(tmp_path / "checkpoints"),
                             "--timeout", "1", *options], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"{complete} complete" in result.stdout, result.stdout[-2000:]


def test_bench_packs_lines_are_read_with_their_numbers() -> None:
    output = ("| comet | 256 | on | fused | 9.27 | 99,455 |  | 34 |\n"
              "\n"
              "phases gate=comet P=256 graphs=on adam=fused between_s=0.010 train_s=7.500 val_s=0.600 end_s=1.160 "
              "train_steps=157 val_batches=20 val_eager=0.900\n"
              "\n"
              "epoch-profile gate=comet P=256 graphs=on adam=fused: the sixth epoch's host time by function\n"
              "profile gate=comet P=256 device=cuda precision=bf16 step_ms=31.250 profiled_step_ms=40.100 "
              "kernel_ms=12.500 kernels=1184 adam_fused_ms=0.800 adam_elementwise_ms=3.100\n")
    assert gpu_check.key_value_lines(output, "profile") == [
        {"gate": "comet", "P": 256.0, "device": "cuda", "precision": "bf16", "step_ms": 31.25,
         "profiled_step_ms": 40.1, "kernel_ms": 12.5, "kernels": 1184.0, "adam_fused_ms": 0.8,
         "adam_elementwise_ms": 3.1}]
    assert gpu_check.key_value_lines("no profile here\n", "profile") == []
    assert gpu_check.throughput(output, "bf16") == [
        {"precision": "bf16", "gate": "comet", "P": 256, "graphs": "on", "epoch_s": 9.27,
         "trial_epochs_per_hour": 99455, "memory_per_trial_mib": "34",
         "phases_s": {"between": 0.01, "train": 7.5, "val": 0.6, "end": 1.16}, "train_steps": 157,
         "val_batches": 20, "val_eager_s": 0.9}]


def test_the_studys_checkpoints_come_back_only_within_the_returned_file_limit(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A study's checkpoints come back as ``checkpoints.tar.gz`` (paths relative to their folder, so that extracting
    it into the folder ``tune --checkpoint-dir`` names resumes them); over the device tool's 16 MiB a file they
    stay, and the summary says so."""
    checkpoints, out = tmp_path / "device-checkpoints", tmp_path / "out"
    out.mkdir()
    assert gpu_check.return_checkpoints(checkpoints, out) == {"files": 0, "bytes": 0, "returned": False}
    folder = checkpoints / "movielens-100k_comet"
    folder.mkdir(parents=True)
    (folder / "host-1.pt").write_bytes(b"\0" * 1000)
    assert gpu_check.return_checkpoints(checkpoints, out) == {"files": 1, "bytes": 1000, "returned": True}
    with tarfile.open(out / "checkpoints.tar.gz") as archive:
        assert archive.getnames() == ["movielens-100k_comet/host-1.pt"]
    (out / "checkpoints.tar.gz").unlink()
    monkeypatch.setattr(gpu_check, "RETURN_LIMIT", 999)
    assert gpu_check.return_checkpoints(checkpoints, out)["returned"] is False
    assert not list(out.iterdir())


def test_the_study_runs_in_one_last_pack_once_nearly_all_its_trials_left_fit_in_it() -> None:
    """TF32: packs of 128 while more than 5/4 of 256 trials are left to run; then one pack of 256 (the lease's study
    so far). bf16 with the mixing's sums fused: one pack of 500 throughout. Each with its fit options; the dry run's
    pack whatever the setting's."""
    tf32, bf16 = gpu_check.STUDY_SETTINGS["tf32"], gpu_check.STUDY_SETTINGS["bf16-fused-sums"]

    def pack(setting: gpu_check.StudySetting, complete: int) -> list[str]:
        return [arg for arg in gpu_check.study_args(gpu_check.GPU, setting, complete) if arg.startswith("--pack")]

    assert pack(tf32, 0) == pack(tf32, 179) == ["--pack=128"]  # 321 left
    assert pack(tf32, 180) == pack(tf32, 234) == pack(tf32, 499) == ["--pack=256"]
    assert pack(bf16, 0) == pack(bf16, 234) == pack(bf16, 499) == ["--pack=500"]
    assert gpu_check.study_args(gpu_check.GPU, tf32, 234)[:-1] == [*gpu_check.GPU.tune_args,
                                                                    "--model.matmul_precision=high"]
    assert gpu_check.study_args(gpu_check.GPU, bf16, 0)[:-1] == [
        *gpu_check.GPU.tune_args, "--trainer.precision=bf16-mixed", "--model.fused_mixing_sums=true"]
    assert gpu_check.study_args(gpu_check.DRY, tf32, 1)[-1] == gpu_check.study_args(gpu_check.DRY, bf16, 1)[-1] \
        == "--pack=2"


def test_gather_restores_the_newest_committed_study_over_an_older_state_of_it(tmp_path: Path) -> None:
    """A lease resumes the study the last one left: ``restore_study`` unpacks the newest ``gpu-<date>[-N]`` folder's
    journal (by date, then N) where ``.gpu/study`` has none or an older state of the study (a prefix: a journal only
    grows), leaves one that holds the committed one (a lease's own, not yet kept), and refuses, in one line, one that
    is another study's."""
    results, study = tmp_path / "results", tmp_path / "study"
    newest = b"one\ntwo\nthree\n"
    for folder, text in (("gpu-2026-11-26", b"one\n"), ("gpu-2026-11-27-2", b"one\ntwo\n"),
                         ("gpu-2026-11-27-10", newest), ("gpu-2026-11-27", b"one\n")):  # -10 after -2 (keep)
        (results / folder).mkdir(parents=True)
        (results / folder / "study.journal.gz").write_bytes(gzip.compress(text))
    restored = results / "gpu-2026-11-27-10" / "study.journal.gz"
    journal = gpu_check.study_journal(study, "tf32")
    assert gpu_check.restore_study(study, results, "tf32") == restored and journal.read_bytes() == newest
    assert gpu_check.restore_study(study, results, "tf32") is None and journal.read_bytes() == newest
    journal.write_bytes(b"one\ntwo\n")  # a state an earlier lease left, stale
    assert gpu_check.restore_study(study, results, "tf32") == restored and journal.read_bytes() == newest
    journal.write_bytes(newest + b"four\n")  # a lease's own, returned, not yet kept
    assert gpu_check.restore_study(study, results, "tf32") is None and journal.read_bytes() == newest + b"four\n"
    journal.write_bytes(b"another study\n")
    assert gpu_check.adopt_newer_state(journal, newest) is None and journal.read_bytes() == b"another study\n"
    with pytest.raises(SystemExit) as refused:
        gpu_check.restore_study(study, results, "tf32")
    assert refused.value.code == 2 and journal.read_bytes() == b"another study\n"
    assert gpu_check.restore_study(tmp_path / "empty", tmp_path / "none", "tf32") is None
    # another setting's studies: their own kept journal, into their own file
    assert gpu_check.restore_study(study, results, "bf16-fused-sums") is None
    (results / "gpu-2026-11-27" / "study-bf16-fused-sums.journal.gz").write_bytes(gzip.compress(b"bf16\n"))
    assert gpu_check.restore_study(study, results, "bf16-fused-sums") == \
        results / "gpu-2026-11-27" / "study-bf16-fused-sums.journal.gz"
    assert gpu_check.study_journal(study, "bf16-fused-sums").read_bytes() == b"bf16\n"
    assert journal.read_bytes() == b"another study\n"


def test_a_tree_changed_since_gather_is_not_named_as_the_gathered_commit(tmp_path: Path, monkeypatch, capsys) -> None:
    """``gather`` records the commit and a digest of the tracked files; on the device, where git's metadata is as
    old as the session, a tree that differs from the recorded one (an edit after ``gather``) gives results named
    ``<commit>+changed-since-gather``, with a note, instead of the commit's name alone."""
    (tmp_path / "a.py").write_text("one")
    (tmp_path / "b.py").write_text("two")
    record = gpu_check.tree_record(tmp_path, ["a.py", "b.py"])
    assert gpu_check.tree_matches(tmp_path, record)
    (tmp_path / "a.py").write_text("one!")
    assert not gpu_check.tree_matches(tmp_path, record)
    (tmp_path / "a.py").write_text("one")
    (tmp_path / "b.py").unlink()
    assert not gpu_check.tree_matches(tmp_path, record)

    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "commit").write_text("abc1234\n")
    monkeypatch.setattr(gpu_check, "CARRIED", carried)
    (carried / "tree.json").write_text(json.dumps(gpu_check.tree_record(ROOT, ["README.md", "pyproject.toml"])))
    found = gpu_check.environment(dry_run=False)
    assert found["commit"] == "abc1234" and found["tree_as_gathered"] is True
    (carried / "tree.json").write_text(json.dumps({"files": ["README.md"], "digest": "0" * 64}))
    found = gpu_check.environment(dry_run=False)
    assert found["commit"] == "abc1234+changed-since-gather" and found["tree_as_gathered"] is False
    assert "differ from those gather recorded with abc1234" in capsys.readouterr().out
    assert gpu_check.environment(dry_run=True)["commit"] == found["git_describe"]  # the dry run: git's own


def test_no_step_outlasts_total(tmp_path: Path) -> None:
    """A step gets at most what is left of ``--total`` (less the budgets kept for report and bootstrap after it, and
    10 s for the summary), and is skipped, saying so, with less than ``MIN_STEP`` left: the device call's limit never
    kills a run before it writes its summary."""
    sizes = dataclasses.replace(gpu_check.DRY, total=22)
    summary = gpu_check.run(tmp_path / "out", sizes, tmp_path / "study", dry_run=True,
                            chosen=("report", "bootstrap"))
    steps = summary["steps"]
    assert re.fullmatch(r"skipped \(\d+ s left of --total\)", steps["report"]["status"]), steps  # bootstrap's kept
    assert re.fullmatch(r"skipped \(\d+ s left of --total\)", steps["bootstrap"]["status"]), steps
    assert steps["tests"]["status"] == "skipped (not in --steps)"
    assert summary["total_s"] < sizes.total and (tmp_path / "out" / "summary.json").exists()


@pytest.mark.integration
def test_a_kernel_the_preflight_does_not_pass_is_trained_as_torch_operations(tmp_path: Path, monkeypatch) -> None:
    """``--steps preflight,study``: the study trains every kernel whose preflight test did not pass (failed, or did
    not run: here a CUDA test, skipped on this CPU) as its torch operations (``MTMOE_PLAIN_KERNELS``), so that no
    trial is trained by a kernel the GPU computes wrongly, and the study still runs; a kernel whose test passed
    stays fused. (The dry run keeps its kernels when their CUDA tests skip: ``dry_run=False`` here, on the CPU.)
    Then the lease's studies in turn (:data:`gpu_check.STUDY_GATES`): with comet's complete the next run trains
    Top-k's into the same journal, and with both complete the study step has nothing to train. A run without the
    preflight in its steps trains as the verdict an earlier run left on the machine decided, and without a verdict it
    runs the preflight first. A lease's second run resumes from the journal the machine kept after its first, which
    is newer than the one the second run carries (here: none)."""
    from mtmoe.plain_kernels import NAMES

    for setting in gpu_check.STUDY_SETTINGS.values():
        assert set(setting.preflight.values()) <= set(NAMES)
    tf32 = dataclasses.replace(gpu_check.STUDY_SETTINGS["tf32"], preflight={
        "tests/test_epilogue.py::test_cuda_equals_cpu[dtype0]": "epilogue",
        "tests/test_plain_kernels.py::test_a_value_names_kernels_or_all_and_an_unknown_name_is_refused": "reach"})
    monkeypatch.setitem(gpu_check.STUDY_SETTINGS, "tf32", tf32)
    sizes = dataclasses.replace(gpu_check.DRY, tune_args=(*gpu_check.DRY.tune_args, "--trainer.accelerator=cpu"))
    verdict, device_journal = tmp_path / "device" / "preflight.json", tmp_path / "device" / "study.journal"
    summary = gpu_check.run(tmp_path / "out", sizes, tmp_path / "study", chosen=("preflight", "study"),
                            verdict_file=verdict, device_journal=device_journal)
    steps = summary["steps"]
    assert steps["preflight"]["status"] == "ok" and summary["preflight"]["skipped"] == 1, summary["preflight"]
    assert steps["study"]["status"] == "ok" and summary["study"]["plain_kernels"] == ["epilogue"], steps
    assert summary["trials_complete"] == gpu_check.DRY.trials
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(gpu_check.study_journal(tmp_path / "study", "tf32"))))
    trials = optuna.load_study(study_name=f"{gpu_check.DATASET}/{gpu_check.GATE}", storage=storage).trials
    assert [t.user_attrs.get("plain_kernels") for t in trials] == [["epilogue"]] * gpu_check.DRY.trials
    assert [t.user_attrs.get("code") for t in trials] == [summary["commit"]] * gpu_check.DRY.trials  # MTMOE_CODE
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as archive:
        log = archive.extractfile("logs/study.log").read().decode()
    assert "note: MTMOE_PLAIN_KERNELS: epilogue run as torch operations (the same values, slower)" in log
    assert "trained them as torch operations, captures eagerly (MTMOE_PLAIN_KERNELS)" in (tmp_path / "out" / "summary.md").read_text()

    assert gpu_check.STUDY_GATES == ("comet", "topk")
    assert json.loads(verdict.read_text()) == {"commit": summary["commit"], "plain": ["epilogue"]}
    assert device_journal.read_bytes() == gpu_check.study_journal(tmp_path / "study", "tf32").read_bytes()
    carried = tmp_path / "carried"  # the second call's .gpu/study: as the lease began, no journal
    summary = gpu_check.run(tmp_path / "out2", sizes, carried, chosen=("study", "report"),
                            verdict_file=verdict, device_journal=device_journal)
    assert summary["study"]["journal_from"] == "device"
    assert "the study resumed from the journal this machine kept" in (tmp_path / "out2" / "summary.md").read_text()
    assert summary["study"]["name"] == "movielens-100k/topk" and summary["trials_complete"] == gpu_check.DRY.trials
    assert summary["steps"]["preflight"]["status"] == "skipped (not in --steps)"
    assert summary["study"]["plain_kernels"] == ["epilogue"] and summary["steps"]["report"]["status"] == "ok"
    assert "the journal's other studies: movielens-100k/comet 2 of 2 configurations evaluated" in \
        (tmp_path / "out2" / "summary.md").read_text()
    report = (tmp_path / "out2" / "report.md").read_text()  # both studies, one journal
    assert "| movielens-100k/topk | topk |" in report and "| movielens-100k/comet | comet |" in report
    another = tmp_path / "another-device" / "preflight.json"  # no verdict there: the preflight runs first
    summary = gpu_check.run(tmp_path / "out3", sizes, carried, chosen=("study",), verdict_file=another)
    assert summary["steps"]["preflight"]["status"] == "ok" and json.loads(another.read_text())["plain"] == ["epilogue"]
    assert summary["steps"]["study"]["status"] == "skipped (the studies of comet, topk are complete)"


@pytest.mark.integration
def test_a_study_setting_trains_its_own_studies_into_its_own_journal(tmp_path: Path) -> None:
    """``run --study bf16-fused-sums`` (the dry run's tiny study, in Triton's interpreter): the trials train in
    bf16-mixed with the mixing's sums fused, recorded in the study's identity, into that setting's journal, which the
    run returns under its own name; TF32's journal is neither made nor read."""
    require_dataset("movielens-100k")
    summary = gpu_check.run(tmp_path / "out", gpu_check.DRY, tmp_path / "study", dry_run=True, chosen=("study",),
                            checkpoint_dir=tmp_path / "checkpoints", setting="bf16-fused-sums")
    assert summary["steps"]["study"]["status"] == "ok" and summary["setting"] == "bf16-fused-sums", summary["steps"]
    assert summary["trials_complete"] == gpu_check.DRY.trials and summary["study"]["pack"] == "2"
    journal = gpu_check.study_journal(tmp_path / "study", "bf16-fused-sums")
    assert summary["study"]["journal"] == str(journal)
    assert not gpu_check.study_journal(tmp_path / "study", "tf32").exists()
    assert {p.name for p in (tmp_path / "out").glob("*.journal.gz")} == {"study-bf16-fused-sums.journal.gz"}
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    settings = optuna.load_study(study_name="movielens-100k/comet", storage=storage).user_attrs["settings"]
    assert settings["trainer.precision"] == "bf16-mixed" and settings["model.fused_mixing_sums"] is True, settings


def test_keep_files_a_lease_under_docs_results(tmp_path: Path) -> None:
    """``keep``: each call's summary and logs, the last call's report, bootstrap table and figures, and each study
    setting's last returned journal, in a new ``gpu-<day>`` folder (``-2`` beside an existing one), which
    ``restore_study`` then restores; a folder that is not a call's is one error line, exit code 2, and nothing
    written."""
    calls = [tmp_path / "1", tmp_path / "2"]
    for index, call in enumerate(calls, 1):
        call.mkdir()
        for file in ("summary.json", "summary.md", "logs.tar.gz"):
            (call / file).write_text(f"{file} of call {index}")
        (call / "study.journal.gz").write_bytes(gzip.compress(f"journal of call {index}".encode()))
    (calls[0] / "study-bf16-fused-sums.journal.gz").write_bytes(gzip.compress(b"bf16 journal of call 1"))
    source = tmp_path / "source"
    for member in gpu_check.KEPT_RESULTS:
        (source / member).parent.mkdir(parents=True, exist_ok=True)
        (source / member).write_text(member)
    (source / "results" / "report" / "table_7.csv").write_text("not kept")
    with tarfile.open(calls[1] / "results.tar.gz", "w:gz") as archive:
        archive.add(source / "results", "results")
    results = tmp_path / "docs" / "results"
    (results / "gpu-2026-11-28").mkdir(parents=True)
    folder = gpu_check.keep(calls, results, "2026-11-28")
    assert folder == results / "gpu-2026-11-28-2"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"call{k}-{f}" for k in (1, 2) for f in ("summary.json", "summary.md", "logs.tar.gz")]
        + list(gpu_check.KEPT_RESULTS.values()) + ["study.journal.gz", "study-bf16-fused-sums.journal.gz"])
    assert (folder / "call1-summary.md").read_text() == "summary.md of call 1"
    assert (folder / "bootstrap.png").read_text() == "results/bootstrap/bootstrap.png"
    assert gzip.decompress((folder / "study.journal.gz").read_bytes()) == b"journal of call 2"
    gpu_check.restore_study(tmp_path / "study", results, "tf32")
    assert gpu_check.study_journal(tmp_path / "study", "tf32").read_text() == "journal of call 2"
    gpu_check.restore_study(tmp_path / "study", results, "bf16-fused-sums")
    assert gpu_check.study_journal(tmp_path / "study", "bf16-fused-sums").read_text() == "bf16 journal of call 1"
    result = subprocess.run([sys.executable, str(SCRIPT), "keep", str(tmp_path / "source")], capture_output=True,
                            text=True)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "has no summary.json" in result.stderr and not result.stdout
