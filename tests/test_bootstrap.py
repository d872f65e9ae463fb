"""``bootstrap`` (Appendix F): known answers on synthetic trial tables, the closed forms against enumeration and
against the Monte-Carlo draws of the same sampling scheme, the reduction factor, and the command line on real
Optuna studies in a temporary SQLite storage, written in the format ``tune`` writes.
"""
from __future__ import annotations

import base64
import contextlib
import io
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState
from scipy.special import comb

from mtmoe import files as files_module
from mtmoe.tuning.bootstrap import (
    Settings,
    best_rank_distribution,
    budget_grid,
    closed_form,
    default_pairs,
    expected_curve,
    factor_range,
    monte_carlo,
    panel_factors,
    ranked_test_losses,
    reduction_factors,
    summarize,
    tuning_curves,
)
from mtmoe.tuning.bands import median_band, objective_curves
from mtmoe.tuning.bootstrap_report import plot

from conftest import run_cli, sqlite_file

optuna.logging.set_verbosity(optuna.logging.WARNING)
LR = optuna.distributions.FloatDistribution(5e-5, 5e-4, log=True)


def table(objectives, test_losses, gate: str = "topk", alpha: str | None = None, data: str = "movielens",
          config_ids=None) -> pd.DataFrame:
    """A trial table as ``report.collect`` returns it (diverged trials: objective +inf)."""
    n = len(objectives)
    return pd.DataFrame({
        "data": data, "study": f"{data}/{gate}" + (f"/alpha={alpha}" if alpha else ""), "gate": gate, "alpha": alpha,
        "config_id": range(n) if config_ids is None else config_ids, "objective": np.asarray(objectives, float),
        "test_loss": np.asarray(test_losses, float), "diverged": ~np.isfinite(np.asarray(objectives, float)),
    })


def correlated_trials(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Validation objective and test loss of n trials: a shared quality plus noise, so the two disagree often."""
    rng = np.random.default_rng(seed)
    quality = 0.40 + rng.exponential(0.02, n)
    return quality + rng.normal(0, 0.005, n), quality + rng.normal(0, 0.005, n)


# --------------------------------------------------------------------------------------------------- closed form


def test_budget_grid_is_appendix_f() -> None:
    grid = budget_grid(250)
    assert len(grid) == 52 and list(grid[:5]) == [1, 2, 5, 10, 15] and grid[-1] == 250
    assert list(budget_grid(12)) == [1, 2, 5, 10] and list(budget_grid(1)) == [1]


@pytest.mark.parametrize("replace", [False, True])
def test_best_rank_distribution_matches_enumeration(replace: bool) -> None:
    """Every draw of s of 6 ranked trials (subsets, or sequences with replacement) enumerated: P(best is rank i)."""
    n = 6
    budgets = np.arange(1, n + 1)
    p = best_rank_distribution(n, budgets, replace)
    for row, s in zip(p, budgets):
        draws = itertools.product(range(n), repeat=s) if replace else itertools.combinations(range(n), s)
        counts = np.bincount([min(draw) for draw in draws], minlength=n)
        assert row == pytest.approx(counts / counts.sum(), abs=1e-14)


def test_hypergeometric_closed_form_at_paper_scale() -> None:
    """N = 500: C(N-i, s-1)/C(N, s) by exact integer binomials, for the whole Appendix F grid."""
    n, grid = 500, budget_grid(250)
    p = best_rank_distribution(n, grid)
    for b in (0, 1, 2, 10, 51):
        s = int(grid[b])
        exact = np.array([comb(n - i, s - 1, exact=True) / comb(n, s, exact=True) for i in range(1, n + 1)])
        assert p[b] == pytest.approx(exact, rel=1e-9, abs=1e-300)
    assert p.sum(axis=1) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("replace", [False, True])
def test_known_answers_s_1_and_s_n(replace: bool) -> None:
    objectives, losses = correlated_trials(40, 0)
    ranked = ranked_test_losses(table(objectives, losses))
    budgets = np.array([1, 40])
    exact = closed_form(ranked, budgets, replace)
    assert exact["exact_mean"][0] == pytest.approx(losses.mean(), rel=1e-12)  # s = 1: any trial, uniformly
    assert exact["exact_std"][0] == pytest.approx(losses.std(), rel=1e-9)
    outcomes = monte_carlo(ranked, budgets, draws=1000, seed=3, replace=replace)
    mc = summarize(outcomes)
    assert abs(mc["mc_mean"][0] - losses.mean()) < 4 * losses.std() / math.sqrt(1000)
    best = losses[np.argmin(objectives)]
    if replace:  # s = N with replacement misses the best trial with probability (1 - 1/N)^N
        assert abs(exact["exact_mean"][1] - best) > 1e-4 and exact["exact_std"][1] > 1e-4
    else:  # s = N without replacement: every draw is the whole bag, whose best-validation trial is fixed
        assert exact["exact_mean"][1] == pytest.approx(best, rel=1e-12) and exact["exact_std"][1] < 1e-9
        assert exact["exact_low"][1] == exact["exact_high"][1] == best
        assert np.all(outcomes[:, 1] == best) and mc["mc_low"][1] == mc["mc_high"][1] == best


@pytest.mark.parametrize("replace", [False, True], ids=["without-replacement", "with-replacement-dodge"])
@pytest.mark.parametrize("resampling", ["nested", "independent"])
def test_monte_carlo_agrees_with_the_closed_form_of_its_scheme(replace: bool, resampling: str) -> None:
    objectives, losses = correlated_trials(60, 1)
    ranked = ranked_test_losses(table(objectives, losses))
    budgets = budget_grid(60)
    draws = 2000
    outcomes = monte_carlo(ranked, budgets, draws, seed=11, replace=replace, resampling=resampling)
    mc = summarize(outcomes)
    exact = closed_form(ranked, budgets, replace)
    error = exact["exact_std"] / math.sqrt(draws)
    assert np.all(np.abs(mc["mc_mean"] - exact["exact_mean"]) <= 4 * error + 1e-12)
    assert mc["mc_se"][:-1] == pytest.approx(error[:-1], rel=0.15)  # the SE estimates the closed form's
    # the exact band's ends are the 2.5% and 97.5% quantiles of the draws' distribution: P(Y <= q) >= level > P(Y < q)
    tolerance = 4 * math.sqrt(0.025 * 0.975 / draws)
    for level, end in ((0.025, exact["exact_low"]), (0.975, exact["exact_high"])):
        assert np.all((outcomes <= end).mean(axis=0) >= level - tolerance)
        assert np.all((outcomes < end).mean(axis=0) <= level + tolerance)
    # like with like: the other scheme's closed form is far off at large budgets (the check can fail)
    other = closed_form(ranked, budgets, not replace)["exact_mean"]
    assert np.abs(mc["mc_mean"][-3:] - other[-3:]).max() > 10 * error[-3:].max()


def test_seeded_draws_are_reproducible_and_per_study() -> None:
    objectives, losses = correlated_trials(50, 2)
    ranked = ranked_test_losses(table(objectives, losses))
    grid = budget_grid(50)
    assert np.array_equal(monte_carlo(ranked, grid, 500, seed=7), monte_carlo(ranked, grid, 500, seed=7))
    assert not np.array_equal(monte_carlo(ranked, grid, 500, seed=7), monte_carlo(ranked, grid, 500, seed=8))
    one = table(objectives, losses, gate="topk")
    two = pd.concat([one, table(*correlated_trials(30, 3), gate="comet")], ignore_index=True)
    alone, together = tuning_curves(one, Settings(draws=300)), tuning_curves(two, Settings(draws=300))
    shared = together[together.gate == "topk"].reset_index(drop=True)
    pd.testing.assert_frame_equal(alone, shared)  # adding a gate leaves the others' draws alone
    assert not tuning_curves(one, Settings(draws=300, seed=1)).mc_mean.equals(alone.mc_mean)


def test_bag_leaves_out_diverged_and_breaks_ties_by_config_id() -> None:
    trials = table(objectives=[0.1, 0.1, math.inf, 0.05, 0.3], test_losses=[1.0, 2.0, 0.0, math.nan, 3.0],
                   config_ids=[5, 3, 1, 2, 4])
    assert list(ranked_test_losses(trials)) == [2.0, 1.0, 3.0]  # config 3 before config 5; 1 and 2 left out
    curves = tuning_curves(trials, Settings(draws=100))
    assert list(curves.s) == [1, 2] and set(curves.trials) == {3} and set(curves.left_out) == {2}
    assert curves.exact_mean.iloc[0] == pytest.approx(2.0)
    assert curves.exact_mean.iloc[1] == pytest.approx((2.0 * 2 + 1.0) / 3)  # best of a pair: rank 1 in 2 of 3


# --------------------------------------------------------------------------------------------------- reduction


def test_reduction_factor_known_answers() -> None:
    grid = budget_grid(10)  # 1, 2, 5, 10
    b = 10.0 - np.arange(10)  # E_B(s) = 11 - s
    better = reduction_factors(b - 2.5, b, grid)
    assert list(better.s_a) == [1, 1, 3, 8]  # levels 10, 9, 6, 1 reached by 8.5 - s at s = 1, 1, 3, 8
    assert list(better.factor) == pytest.approx([1, 2, 5 / 3, 10 / 8])
    assert list(better.bound) == [">=", ">=", "", ""]
    assert factor_range(better) == {"factor_min": 1.25, "factor_max": 2.0, "s_b_at_min": 10, "s_b_at_max": 2,
                                    "min_bound": "", "max_bound": ">=", "never": 0}
    worse = reduction_factors(b + 0.5, b, grid)
    assert list(worse.factor[:3]) == pytest.approx([1 / 2, 2 / 3, 5 / 6]) and worse.bound.iloc[3] == "never"
    assert factor_range(worse)["never"] == 1 and math.isnan(worse.factor.iloc[3])
    # a curve that rises (best validation is not best test): B's own first budget at its level counts
    rising = np.array([3.0, 1.0, 2.0, 2.0, 2.0])
    same = reduction_factors(rising, rising, budget_grid(5))
    assert list(same.s_b_reach) == [1, 2, 2] and list(same.factor) == [1.0, 1.0, 1.0]


def test_identical_gates_give_1_and_a_uniformly_better_gate_more() -> None:
    objectives, losses = correlated_trials(200, 4)
    trials = pd.concat([table(objectives, losses, gate="hash"), table(objectives, losses, gate="hash+"),
                        table(objectives, losses - 0.003, gate="topk")], ignore_index=True)
    factors, ranges = panel_factors(trials, [("hash+", "hash"), ("topk", "hash"), ("hash", "topk")])
    ranges = ranges.set_index(["gate_a", "gate_b"])
    identical = factors[factors.gate_a == "hash+"]
    assert len(identical) == len(budget_grid(200)) and (identical.factor == 1.0).all() and (identical.bound == "").all()
    assert ranges.loc[("hash+", "hash")].factor_min == ranges.loc[("hash+", "hash")].factor_max == 1.0
    better = factors[factors.gate_a == "topk"]
    assert (better.factor >= 1.0).all() and ranges.loc[("topk", "hash")].factor_max > 2.0
    assert (factors[factors.gate_a == "hash"].factor.dropna() <= 1.0).all()  # and the other way round, below 1


def test_plot_has_an_overview_a_panel_per_gate_family_and_one_per_factor_pair() -> None:
    trials = pd.concat([table(*correlated_trials(20, 5), gate=gate, alpha=alpha, data=data)
                        for data, alphas in (("movielens", ("0.1", "0.9")), ("books", (None,)))
                        for alpha in alphas for gate in ("topk", "topk+")], ignore_index=True)
    curves = tuning_curves(trials, Settings(draws=50))
    figure = plot(curves, objective_curves(trials), ["topk+", "topk"], [("topk+", "topk")], 0.95)
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == [f"{panel}: {what}" for panel in ("books, α = -", "movielens, α = 0.1", "movielens, α = 0.9")
                      for what in ("all gates", "topk vs topk+", "all gates, objective", "topk vs topk+, objective")]
    for overview, family, medians, exact in zip(*(figure.axes[i::4] for i in range(4))):
        for curves_only in (overview, medians):  # means or medians, no band
            assert [line.get_label() for line in curves_only.get_lines()] == ["topk", "topk+"]
            assert not curves_only.collections
        assert [band.get_hatch() for band in family.collections] == ["////", "\\\\\\\\"]
        assert [line.get_label() for line in family.get_lines()] == ["topk", "topk+"]
        assert len(exact.collections) == 2 and not any(band.get_hatch() for band in exact.collections)  # filled
        assert len(exact.get_lines()) == 2 * 3  # per gate: the median and the band's two edges
        high = 100 * curves[curves.gate == "topk"].mc_high.max()
        assert family.get_ylim()[1] > high and overview.get_ylim()[1] < high  # bands fit their panels
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["topk", "topk+", "test loss: spread of the draws", "objective: exact 95% band",
                      "dashed: without local search", 'solid: with local search ("+")']


def test_plot_of_eight_trials_marks_its_budgets_and_explains_only_what_it_draws() -> None:
    """Issue 22: 8 trials give 3 budgets, drawn as bare lines; the "+" line style explained with no "+" gate drawn."""
    trials = pd.concat([table(*correlated_trials(8, 5), gate="topk"), table(*correlated_trials(8, 6), gate="comet")],
                       ignore_index=True)
    figure = plot(tuning_curves(trials, Settings(draws=50)), objective_curves(trials), ["topk", "comet"],
                  [("comet", "topk")], 0.95)
    assert [ax.get_title() for ax in figure.axes] == [
        "movielens, α = -: all gates", "movielens, α = -: topk", "movielens, α = -: comet",
        "movielens, α = -: all gates, objective", "movielens, α = -: topk vs comet, objective"]
    for line in figure.axes[0].get_lines():
        assert line.get_marker() == "o" and list(line.get_xdata()) == [1, 2, 5]
    for ax in figure.axes[3:]:
        medians = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert [line.get_markevery() for line in medians] == [[0, 1, 4]] * 2  # of s = 1..8, the grid's 1, 2, 5
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["topk", "comet", "test loss: spread of the draws", "objective: exact 95% band"]


# --------------------------------------------------------------------------------------------------- command line


def add_study(storage, data: str, gate: str, objectives, test_losses, alpha: str | None = None,
              diverged: int = 0, planned: int | None = None) -> str:
    """A finished study as ``tune`` leaves it: study attributes, one enqueued-and-completed trial per config_id
    with tune's user attributes, ``diverged`` extra configurations failed with a reason (their test loss set, as
    tune sets it before it sees the NaN), and the noise the readers must skip (a lost trial, a skipped duplicate).
    ``planned``: the configurations its plan has, where more than those (an unfinished study)."""
    name = f"{data}/{gate}" + (f"/alpha={alpha}" if alpha else "")
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize")
    n = len(objectives) + diverged
    attrs = {"space_fingerprint": "0" * 16, "seed": 0, "data": data, "gate": gate, "trials": planned or n,
             **({"alpha": alpha} if alpha else {})}
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    for config_id in range(n):
        loss = float(test_losses[config_id]) if config_id < len(objectives) else 0.0
        user = {"config_id": config_id, "config_hash": f"{config_id:012d}", "seed": config_id, "wall_time_s": 1.0,
                "epochs_run": 3, "best_epoch": 2, "test/loss": loss, "test_loss": loss,
                "test/watch/experts_per_sample": 2.0, "test/rating/experts_per_sample": 2.0}
        if config_id < len(objectives):
            trial = optuna.trial.create_trial(value=float(objectives[config_id]), params={"model.lr": 1e-4},
                                              distributions={"model.lr": LR}, user_attrs=user)
        else:
            trial = optuna.trial.create_trial(state=TrialState.FAIL, params={"model.lr": 1e-4},
                                              distributions={"model.lr": LR},
                                              user_attrs={**user, "fail_reason": "diverged: train loss nan"})
        study.add_trial(trial)
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"config_id": 0}))  # lost
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, user_attrs={"config_id": 1}))  # duplicate
    return name


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> tuple[str, dict]:
    """movielens at two alphas; hash+ identical to hash, topk+ = topk with every test loss 0.005 lower."""
    trials = {}

    def build(into) -> None:
        for alpha, n in (("0.1", 30), ("0.9", 20)):
            objectives, losses = correlated_trials(n, int(float(alpha) * 10))
            for gate, shift, diverged in (("hash", 0.0, 2), ("hash+", 0.0, 0), ("topk", 0.05, 0),
                                          ("topk+", 0.045, 1)):
                add_study(into, "movielens", gate, objectives, losses + shift, alpha, diverged)
                trials[(alpha, gate)] = (objectives, losses + shift)
        add_study(into, "books", "topk", *correlated_trials(10, 9))  # another dataset: not read
        add_study(into, "tiny", "topk", *correlated_trials(5, 9))  # too few trials for the exact bands
        add_study(into, "one", "topk", [0.4], [0.41])

    return sqlite_file(tmp_path_factory.mktemp("boot") / "studies.db", build), trials


def run_bootstrap(url: str, out: Path, *extra: str, data: str = "movielens") -> int:
    return run_cli(["bootstrap", "--data", data, "--storage", url, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def end_to_end(storage, tmp_path_factory) -> tuple[Path, str]:
    """One run over the four gates' movielens studies at both alphas (400 draws; each run fits every study's noisy
    quadratic, most of its time): its folder and what it printed. The end-to-end, options and atomic-output tests
    read it (the tests of ``storage`` share an ``xdist_group``: one worker builds it and runs this once)."""
    out = tmp_path_factory.mktemp("end-to-end") / "rep"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run_bootstrap(storage[0], out, "--gates", "topk,topk+,hash,hash+", "--draws", "400") == 0
    return out, printed.getvalue()


STARTUP_RUN = """\
import sys
from mtmoe.cli import main

def imported():
    return sorted({{name.split(".")[0] for name in sys.modules}} & {{"torch", "lightning"}})

main(["report", "--data", "books", "--storage", {url!r}, "--out", "rep", "--importance", "none"])
print("report imported", imported())
main(["bootstrap", "--data", "books", "--storage", {url!r}, "--out", "boot", "--draws", "50"])
print("bootstrap imported", imported())
"""


@pytest.mark.integration
@pytest.mark.xdist_group("bootstrap-storage")
def test_report_and_bootstrap_import_no_lightning(storage, tmp_path: Path) -> None:
    """A fresh interpreter: ``report`` finds the books study's default alpha (it has none of its own) without
    importing torch or Lightning, ``bootstrap`` imports torch for its draws only, never Lightning."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", STARTUP_RUN.format(url=storage[0])], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "report imported []" in proc.stdout and "bootstrap imported ['torch']" in proc.stdout
    table = pd.read_csv(tmp_path / "rep" / "table_2_3.csv", dtype={"alpha": str})
    assert list(table.alpha) == ["0.9"]


@pytest.mark.xdist_group("bootstrap-storage")
def test_cli_end_to_end(storage, end_to_end) -> None:
    _, trials = storage
    out, printed = end_to_end
    curves = pd.read_csv(out / "bootstrap_curves.csv", dtype={"alpha": str})
    assert sorted(set(zip(curves.alpha, curves.gate))) == sorted(trials)
    for (alpha, gate), (objectives, losses) in trials.items():
        rows = curves[(curves.alpha == alpha) & (curves.gate == gate)].set_index("s")
        n = len(objectives)
        assert list(rows.index) == list(budget_grid(n)) and set(rows.trials) == {n}
        assert rows.exact_mean[1] == pytest.approx(losses.mean(), rel=1e-12)  # s = 1: the mean test loss
        best = losses[np.argmin(objectives)]
        assert rows.exact_mean[n] == pytest.approx(best) and rows.mc_mean[n] == pytest.approx(best)  # s = N
        assert (abs(rows.mc_mean - rows.exact_mean) <= 4 * rows.exact_std / math.sqrt(400) + 1e-12).all()
    assert set(curves[curves.gate == "hash"].left_out) == {2}

    ranges = pd.read_csv(out / "bootstrap_ranges.csv", dtype={"alpha": str}).set_index(["alpha", "gate_a"])
    assert sorted(ranges.index) == [(a, g) for a in ("0.1", "0.9") for g in ("hash+", "topk+")]  # the "+" pairs
    for alpha in ("0.1", "0.9"):
        assert ranges.loc[(alpha, "hash+")].factor_min == ranges.loc[(alpha, "hash+")].factor_max == 1.0
        assert ranges.loc[(alpha, "topk+")].factor_min >= 1.0 and ranges.loc[(alpha, "topk+")].factor_max > 1.0
    factors = pd.read_csv(out / "bootstrap_factors.csv", dtype={"alpha": str})
    assert len(factors[(factors.alpha == "0.1") & (factors.gate_a == "hash+")]) == len(budget_grid(30))

    objective = pd.read_csv(out / "bootstrap_objective.csv", dtype={"alpha": str},
                            float_precision="round_trip")  # exact on pandas 2 too (pandas 3 parses so by default)
    for (alpha, gate), (objectives, _) in trials.items():
        rows = objective[(objective.alpha == alpha) & (objective.gate == gate)]
        failed = {"hash": 2, "topk+": 1}.get(gate, 0)
        values = np.r_[objectives, [np.inf] * failed]  # a failed configuration is a draw of +inf
        band = median_band(values, np.arange(1, len(values) + 1), 0.95)
        assert list(rows.s) == list(range(1, len(values) + 1)) and set(rows.failed) == {failed}
        for column in ("median", "low", "high"):
            assert rows[column].tolist() == band[column].tolist()
    detail = pd.read_csv(out / "bootstrap_objective_factors.csv", dtype={"alpha": str})
    assert sorted(set(zip(detail.alpha, detail.gate_a, detail.gate_b))) == sorted(
        (a, f"{g}+", g) for a in ("0.1", "0.9") for g in ("hash", "topk"))
    defined = detail[detail.factor.notna()]
    assert (defined.factor_low <= defined.factor).all() and (defined.factor <= defined.factor_high).all()
    assert {"median_min", "unbiased_max", "interval_low", "interval_high_bound"} <= set(ranges.columns)

    png = (out / "bootstrap.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    markdown = (out / "bootstrap.md").read_text()
    assert "![tuning curves](bootstrap.png)" in markdown and markdown in printed
    assert "| movielens | 0.1 | topk+ over topk |" in markdown and "**movielens, α = 0.9**" in markdown
    for block in markdown.split("\n\n"):  # every Markdown table row has its header's number of cells
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({row.count("|") for row in rows}) <= 1, block
    page = (out / "bootstrap.html").read_text()
    inlined = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert "objective's tuning curve with exact 95% confidence bands" in markdown
    assert "| movielens | 0.9 | topk+ over topk | " in markdown.split("Median factor [95% interval]")[1]
    # the objective's 2 panels, the noisy quadratic model, the paper's factors, the objective's, at selected budgets,
    # studies, 2 test-loss panels
    assert base64.b64decode(inlined) == png and page.count("<table>") == 9

    from mtmoe.tuning.parametric import estimate  # the model of each study: opda's, on its objectives

    parametric = pd.read_csv(out / "bootstrap_parametric.csv", dtype={"alpha": str}).set_index(["alpha", "gate"])
    assert sorted(parametric.index) == sorted(trials)
    objectives, _ = trials[("0.9", "topk+")]
    expected = estimate(np.r_[objectives, np.inf], 1, 0.95, 0.01)  # topk+ has one failed trial, dims: model.lr
    row = parametric.loc[("0.9", "topk+")]
    assert row.dims == 1 and row.evaluated == 21
    for key in ("best", "best_low", "best_high", "trials_within", "c", "o", "tail"):
        assert row[key] == pytest.approx(expected[key], rel=1e-9), key
    assert "## The best objective a gate can reach: the noisy quadratic model" in markdown
    assert f"| movielens/topk+/alpha=0.9 | topk+ | 0.9 | 21 ({expected['tail']}, 1) | {100 * expected['best']:.2f} |" \
        in markdown
    assert not list(out.glob(".*"))  # atomic writes leave no temporary files


@pytest.mark.xdist_group("bootstrap-storage")
def test_cli_seed_and_options(storage, end_to_end, tmp_path: Path, capsys) -> None:
    """The seed on the one tiny study (the draws are per study: ``test_seeded_draws_are_reproducible_and_per_study``;
    its 5 trials are drawn without the exact bands and the noisy quadratic fit, which the curves compared do not
    hold), the options on two gates' movielens studies against the end-to-end run's (no replacement, nested)."""
    url, _ = storage
    read = lambda name: pd.read_csv(tmp_path / name / "bootstrap_curves.csv", dtype={"alpha": str})
    for name, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        assert run_bootstrap(url, tmp_path / name, "--draws", "200", "--seed", seed, data="tiny") == 0
    pd.testing.assert_frame_equal(read("a"), read("b"))
    assert not read("a").mc_mean.equals(read("c").mc_mean) and read("a").exact_mean.equals(read("c").exact_mean)
    assert run_bootstrap(url, tmp_path / "d", "--gates", "hash,topk", "--draws", "200", "--replacement", "--resample",
                         "independent", "--max-budget", "20", "--pairs", "hash:topk") == 0
    plain = pd.read_csv(end_to_end[0] / "bootstrap_curves.csv", dtype={"alpha": str})
    both = read("d").merge(plain, on=["alpha", "gate", "s"], suffixes=("", "_plain"))
    assert read("d").s.max() == 20 and len(both) == len(read("d")) and set(both.gate) == {"hash", "topk"}
    first, later = both[both.s == 1], both[both.s > 1]  # s = 1: the mean test loss under either scheme
    assert np.allclose(first.exact_mean, first.exact_mean_plain, rtol=1e-12)
    assert (abs(later.exact_mean - later.exact_mean_plain) > 1e-9).all()
    ranges = pd.read_csv(tmp_path / "d" / "bootstrap_ranges.csv")
    assert list(zip(ranges.gate_a, ranges.gate_b)) == [("hash", "topk")] * 2
    assert "with replacement; closed form of Dodge et al. 2019" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gates", "topk,comet"], "no study with finished trials for gate 'comet' of dataset 'movielens'"),
        (["--max-budget", "25"], "has 20 completed trials, fewer than --max-budget 25"),
        (["--data", "jester"], "no studies for dataset 'jester'"),
        (["--data", "empty"], "have no finished trials yet"),
        (["--storage", "sqlite:///{tmp}/missing.db"], "no study storage at"),
        (["--pairs", "topk:comet", "--gates", "topk"], "--pairs: 'topk:comet' is not A:B"),
        (["--draws", "1"], "--draws must be >= 2"),
        (["--confidence", "1"], "--confidence must be in (0, 1), got 1"),
        (["--confidence", "0"], "--confidence must be in (0, 1), got 0"),
        (["--confidence", "nan"], "--confidence must be in (0, 1), got nan"),
        (["--confidence", "high"], "argument --confidence: invalid float value: 'high'"),
        (["--draws", "many"], "bootstrap: argument --draws: invalid int value: 'many'"),
        (["--within", "0"], "--within must be in (0, 1), got 0"),
        (["--resample", "bogus"], "invalid choice: 'bogus'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
@pytest.mark.xdist_group("bootstrap-storage")
def test_cli_bad_input_one_line_exit_2(storage, tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    url, _ = storage
    empty = optuna.create_study(study_name="empty/topk", storage=url, load_if_exists=True)  # a study, no trials
    empty.set_user_attr("data", "empty")
    empty.set_user_attr("gate", "topk")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    data = [] if "--data" in argv else ["--data", "movielens"]
    storage_flag = [] if "--storage" in argv else ["--storage", url]
    assert run_cli(["bootstrap", *data, *storage_flag, *argv, "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "rep").exists() and not (tmp_path / "missing.db").exists()


@pytest.mark.parametrize("argv, note", [
    (["--data", "tiny"], "note: 'tiny/topk' has 5 evaluated trials: the exact 95% bands and the factors' intervals "
                         "need at least 8, left out"),
    (["--data", "one"], "note: 'one/topk' has 1 evaluated trial: the exact 95% bands"),
    (["--data", "books", "--confidence", "0.99"],
     "note: 'books/topk' has 10 evaluated trials: the exact 99% bands and the factors' intervals need at least 11"),
])
@pytest.mark.xdist_group("bootstrap-storage")
def test_cli_too_few_trials_for_the_bands_draws_the_rest_with_a_note(storage, tmp_path: Path, capsys,
                                                                     argv: list[str], note: str) -> None:
    """Issue 32: a study too small for the exact bands gets the paper's bootstrap, its closed forms and the median
    and expected curves; the bands and factor intervals are left out, with one note line; exit 0."""
    assert run_cli(["bootstrap", "--storage", storage[0], *argv, "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(note), err
    model_notes = [] if "books" in argv else [f"note: '{argv[1]}/topk': "]  # 5 trials and 1: too few for the model
    assert [line[:len(start)] for line, start in zip(err[1:], model_notes)] == model_notes and len(err) == 1 + len(
        model_notes), err
    objective = pd.read_csv(tmp_path / "rep" / "bootstrap_objective.csv")
    assert objective["median"].notna().all() and objective.expected.notna().all()
    assert objective.low.isna().all() and objective.high.isna().all()
    curves = pd.read_csv(tmp_path / "rep" / "bootstrap_curves.csv")
    assert curves.exact_mean.notna().all() and curves.mc_mean.notna().all()
    assert (tmp_path / "rep" / "bootstrap.png").read_bytes().startswith(b"\x89PNG")


def test_a_four_trial_study_gives_a_figure_a_note_and_exit_0(tmp_path: Path, capsys) -> None:
    """Issue 32: README's 4-trial smoke studies, one gate with a failed trial: every panel on the same budget axis,
    the figure states N and the training budget, the pair's point factors without their interval."""
    from mtmoe.tuning.bootstrap_report import budgets, plot
    from mtmoe.tuning.trials import collect

    url = f"sqlite:///{tmp_path / 'small.db'}"
    add_study(url, "smoke", "topk", *correlated_trials(4, 1))
    add_study(url, "smoke", "comet", *correlated_trials(3, 2), diverged=1)
    assert run_cli(["bootstrap", "--data", "smoke", "--storage", url, "--out", str(tmp_path / "rep")]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "note: 'smoke/topk' has 4, 'smoke/comet' has 4 evaluated trials: the exact 95% bands and the factors' "
        "intervals need at least 8, left out (run more trials or lower --confidence); the bootstrap and the closed "
        "forms are drawn",
        *(f"note: 'smoke/{gate}': {finite} finite of 4 trials: the noisy quadratic model needs at least 8, and 4 "
          "finite in its tail (run more trials)" for gate, finite in (("topk", 4), ("comet", 3)))]
    assert "whose bands (and factor intervals) are left out: `smoke/topk`, `smoke/comet`" in captured.out
    assert (tmp_path / "rep" / "bootstrap.png").read_bytes().startswith(b"\x89PNG")
    detail = pd.read_csv(tmp_path / "rep" / "bootstrap_objective_factors.csv")
    assert detail.factor.notna().all() and detail.factor_low.isna().all() and detail.factor_high.isna().all()

    trials = collect(url, "smoke")[1]
    assert budgets(trials) == "smoke/topk: N = 4 trials, 3 epochs each; smoke/comet: N = 4 trials, 3 epochs each"
    settings = Settings(draws=50)
    figure = plot(tuning_curves(trials, settings), objective_curves(trials, settings), ["topk", "comet"],
                  [("comet", "topk")], 0.95, budgets(trials))
    assert figure.get_suptitle() == budgets(trials)
    assert {ax.get_xlim() for ax in figure.axes} == {(1, 4)}
    assert {tuple(ax.get_xticks()) for ax in figure.axes} == {(1, 2, 4)}
    assert not any(ax.collections for ax in figure.axes[3:])  # no exact band drawn
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["topk", "comet", "test loss: spread of the draws"]


def test_cli_missing_data_is_one_line(capsys) -> None:
    assert run_cli(["bootstrap"]) == 2
    assert capsys.readouterr().err.strip() == "error: bootstrap: the following arguments are required: --data"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")
@pytest.mark.xdist_group("bootstrap-storage")
def test_cli_cuda_without_a_gpu_is_one_line(storage, tmp_path: Path, capsys) -> None:
    assert run_bootstrap(storage[0], tmp_path / "rep", "--device", "cuda") == 2
    assert capsys.readouterr().err.strip() == "error: --device cuda: no CUDA device is available here"


@pytest.mark.xdist_group("bootstrap-storage")
def test_outputs_are_replaced_atomically(storage, end_to_end, tmp_path: Path, monkeypatch, capsys) -> None:
    """A run that fails while writing leaves the previous outputs (a copy of the end-to-end run's, every output)
    whole and no temporary file behind; the failing run reads the one books study, the cheapest to get there."""
    out = tmp_path / "rep"
    shutil.copytree(end_to_end[0], out)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert set(before) == {"bootstrap.png", "bootstrap.pdf", "bootstrap.md", "bootstrap.html", "bootstrap_curves.csv",
                           "bootstrap_factors.csv", "bootstrap_ranges.csv", "bootstrap_objective.csv",
                           "bootstrap_objective_factors.csv", "bootstrap_parametric.csv"}
    replace = files_module.os.replace

    def fail_on_png(source, target):
        if str(target).endswith(".png"):
            raise OSError("disk full")
        replace(source, target)

    monkeypatch.setattr(files_module.os, "replace", fail_on_png)
    assert run_bootstrap(storage[0], out, "--draws", "100", "--seed", "9", data="books") == 2
    assert capsys.readouterr().err.strip() == f"error: cannot write the outputs to {out} (disk full): pass a " \
                                              "writable --out folder, or free some space there"
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_gpu_draws_match_the_closed_form() -> None:
    """``--device cuda`` (run where a GPU is): the same estimator, checked against the closed form."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    objectives, losses = correlated_trials(500, 6)
    ranked = ranked_test_losses(table(objectives, losses))
    grid = budget_grid(250)
    for resampling in ("nested", "independent"):
        outcomes = monte_carlo(ranked, grid, 1000, seed=1, resampling=resampling, device="cuda")
        assert np.array_equal(outcomes, monte_carlo(ranked, grid, 1000, seed=1, resampling=resampling, device="cuda"))
        exact = closed_form(ranked, grid)
        error = exact["exact_std"] / math.sqrt(1000)
        assert np.all(np.abs(outcomes.mean(0) - exact["exact_mean"]) <= 4 * error + 1e-12)
    assert expected_curve(ranked)[0] == pytest.approx(losses.mean())


# ------------------------------------------------------------------------------ the figure at paper scale (14.9)

PAPER_ORDER = ["topk", "topk+", "hash", "hash+", "comet", "comet+"]
#: Each gate's offset of quality over the best, ×(the alpha's loss scale); written in this (scrambled) order.
PAPER_SCALE_GATES = {"comet+": 0.0, "hash": 0.012, "topk+": 0.004, "comet": 0.002, "hash+": 0.007, "topk": 0.008}


def write_paper_scale(url: str, trials: int = 250) -> None:
    """Figures 2-3's scale in the format tune writes: the 6 gates of docs/studies.md's bootstrap example at two alphas, 250
    trials each; alpha 0.9 as the default (tune without --model.alpha: no alpha in the name or attributes)."""
    from mtmoe.tuning.storage import storage_for

    storage = storage_for(url)
    for alpha, scale in (("0.1", 0.75), ("0.9", 0.41)):
        for index, (gate, offset) in enumerate(PAPER_SCALE_GATES.items()):
            rng = np.random.default_rng([index, int(float(alpha) * 10)])
            name = f"movielens/{gate}" + ("/alpha=0.1" if alpha == "0.1" else "")
            study = optuna.create_study(study_name=name, storage=storage)
            attrs = {"data": "movielens", "gate": gate, "seed": 0, "trials": trials, "space_fingerprint": "0" * 16,
                     "settings": {"trainer.max_epochs": 100}, **({"alpha": alpha} if alpha == "0.1" else {})}
            for key, value in attrs.items():
                study.set_user_attr(key, value)
            quality = scale * (1 + offset / 0.41) + rng.gamma(1.5, 0.02 * scale / 0.41, trials)
            study.add_trials([optuna.trial.create_trial(
                value=float(quality[c] + rng.normal(0, 0.004)), params={"model.lr": 1e-4},
                distributions={"model.lr": LR},
                user_attrs={"config_id": c, "test_loss": float(quality[c] + rng.normal(0, 0.004)),
                            "test/watch/experts_per_sample": 2.0, "test/rating/experts_per_sample": 2.0})
                for c in range(trials)])


@pytest.fixture(scope="module")
def paper_scale(tmp_path_factory) -> str:
    url = f"journal:{tmp_path_factory.mktemp('paper') / 'studies.log'}"
    write_paper_scale(url)
    return url


@pytest.mark.slow
def test_the_figure_at_paper_scale_tells_every_gate_apart(paper_scale: str) -> None:
    """Before: a gate and its "+" in one colour, six translucent bands in one panel, no word on what dashed means, raw
    losses on the y axis, no alpha in the title of the default alpha's panel."""
    from mtmoe.tuning.trials import collect

    _, trials = collect(paper_scale, "movielens")
    gates = list(PAPER_SCALE_GATES)
    figure = plot(tuning_curves(trials, Settings(draws=200)), objective_curves(trials), gates, default_pairs(gates),
                  0.95)
    axes = figure.axes
    assert [ax.get_title() for ax in axes] == [
        f"movielens, α = {alpha}: {what}" for alpha in ("0.1", "0.9")
        for what in ("all gates", "topk vs topk+", "hash vs hash+", "comet vs comet+", "all gates, objective",
                     "topk vs topk+, objective", "hash vs hash+, objective", "topk vs comet, objective",
                     "hash vs comet, objective", "comet vs comet+, objective")]
    for ax in axes:
        objective = ax.get_title().endswith("objective")
        label = "best validation objective ×10⁻²" if objective else "test loss ×10⁻²"
        assert ax.get_ylabel() == label and 30 < ax.get_ylim()[0] < ax.get_ylim()[1] < 120
        means = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
        assert len({tuple(line.get_color()) if not isinstance(line.get_color(), str) else line.get_color()
                    for line in means.values()}) == len(means)  # every gate its own colour, "+" too
        for gate, line in means.items():
            assert (line.get_linestyle() == "-") == gate.endswith("+")  # dashed: without local search
        assert len(ax.collections) == (0 if "all gates" in ax.get_title() else 2)  # a band per gate
    assert [line.get_label() for line in axes[0].get_lines()] == PAPER_ORDER
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend[:6] == PAPER_ORDER and "dashed: without local search" in legend
    assert 'solid: with local search ("+")' in legend


@pytest.mark.slow
def test_reports_come_in_the_papers_order_with_alpha(tmp_path: Path, capsys) -> None:
    """Rows by dataset, alpha, then the paper's gate order, the default alpha shown (before: alphabetical, comet+
    before comet, an empty alpha). The paper-scale studies with 30 trials each, not 250: the order does not depend
    on N, and the exact bands and the noisy quadratic fits cost far more at 250."""
    url = f"journal:{tmp_path / 'studies.log'}"
    write_paper_scale(url, trials=30)
    out = tmp_path / "rep"
    assert run_cli(["bootstrap", "--data", "movielens", "--storage", url, "--out", str(out)]) == 0
    assert run_cli(["report", "--data", "movielens", "--storage", url, "--out", str(out)]) == 0
    expected = [(alpha, gate) for alpha in ("0.1", "0.9") for gate in PAPER_ORDER]
    curves = pd.read_csv(out / "bootstrap_curves.csv", dtype={"alpha": str})
    assert list(dict.fromkeys(zip(curves.alpha, curves.gate))) == expected
    pairs = [("topk+", "topk"), ("hash+", "hash"), ("comet", "topk"), ("comet", "hash"), ("comet+", "comet")]
    for name in ("bootstrap_ranges.csv", "bootstrap_factors.csv"):
        frame = pd.read_csv(out / name, dtype={"alpha": str})
        assert list(dict.fromkeys(zip(frame.alpha, frame.gate_a, frame.gate_b))) == \
            [(alpha, *pair) for alpha in ("0.1", "0.9") for pair in pairs], name
    for name in ("table_2_3.csv", "table_7.csv"):
        frame = pd.read_csv(out / name, dtype={"alpha": str})
        assert list(zip(frame.alpha, frame.gate)) == expected, name
    printed = capsys.readouterr().out
    for document in ((out / "bootstrap.md").read_text(), (out / "report.md").read_text()):
        assert document in printed
        rows = re.findall(r"^\| (movielens/[^ ]+) \| ([^ ]+) \| ([^ ]+) \|", document, re.M)
        studies = list(dict.fromkeys((alpha, gate) for _, gate, alpha in rows))
        assert studies == expected
    assert "**movielens, α = 0.9**" in (out / "bootstrap.md").read_text()
    assert (out / "bootstrap.pdf").read_bytes().startswith(b"%PDF")


def test_an_unfinished_study_is_flagged_by_report_and_bootstrap(tmp_path: Path, capsys) -> None:
    """A study with fewer evaluated configurations than it plans (a GPU study resumed lease by lease) says so: its
    trials finished in the order they stopped, so report's and bootstrap's figures are provisional. One note line
    each on stderr, the same note in report.md and bootstrap.md, "10 of 20" trials in Tables 2-3, and N "of 20
    planned" in the figure's title; a finished study is not named."""
    from mtmoe.tuning.bootstrap_report import budgets
    from mtmoe.tuning.trials import collect

    url = f"sqlite:///{tmp_path / 'unfinished.db'}"
    add_study(url, "half", "topk", *correlated_trials(10, 1), planned=20)
    add_study(url, "half", "comet", *correlated_trials(10, 2))
    note = ("unfinished: 'half/topk' has 10 of its 20 configurations evaluated. A study's trials finish in the order "
            "they stop, those that stop early first, so its evaluated configurations are not a random sample of its "
            "plan, and its top trials and tuning curves can move as the rest finish: run the same tune command to "
            "finish it before citing these figures")
    bold = f"**{note[:1].upper()}{note[1:]}.**"
    assert run_cli(["report", "--data", "half", "--storage", url, "--out", str(tmp_path / "rep"),
                    "--importance", "none"]) == 0
    assert capsys.readouterr().err.splitlines() == [f"note: {note}"]
    text = (tmp_path / "rep" / "report.md").read_text()
    tables_2_3 = text.split("## Tables 2-3")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0]: line.split(" | ")[3] for line in tables_2_3.splitlines() if line.startswith("| half/")}
    assert rows == {"| half/topk": "10 of 20", "| half/comet": "10"} and bold in tables_2_3
    assert run_cli(["bootstrap", "--data", "half", "--storage", url, "--out", str(tmp_path / "rep")]) == 0
    assert capsys.readouterr().err.splitlines()[0] == f"note: {note}"
    assert bold in (tmp_path / "rep" / "bootstrap.md").read_text()
    assert budgets(collect(url, "half")[1]) == ("half/topk: N = 10 of 20 planned trials, 3 epochs each; "
                                               "half/comet: N = 10 trials, 3 epochs each")
