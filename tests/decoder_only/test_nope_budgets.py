"""The NoPE budget sweep's plan: every budget a finished schedule branched from one stable run
(`decoder_only/nope_budgets.py`); no training here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.decoder_only import nope_budgets, order_floor
from scalestudy.decoder_only.budget_gap import BudgetRun
from scalestudy.train.optim import make_schedule

SPEC = Path(__file__).resolve().parents[2] / "configs" / "studies" / "nope_order_budgets.yaml"


def test_each_budget_branches_from_the_stable_run_where_its_cooldown_starts(tmp_path):
    study = nope_budgets.load_sweep(SPEC)
    sweep = study.experiments.budgets
    planned = nope_budgets.plan_budget_runs(study, SPEC.parent, tmp_path)
    assert {r.variant for r, _ in planned} == {sweep.reference, sweep.treatment}
    assert [r.seed for r, _ in planned] == sorted(r.seed for r, _ in planned)  # seed-major
    top = sweep.steps[-1]
    for run, configs in planned:
        stable = configs[top]
        assert stable.optim.schedule == "wsd" and stable.train.init_from is None
        kept = stable.train.keep_every
        for budget in sweep.steps[:-1]:
            branch = configs[budget]
            start = branch.train.init_step
            assert branch.train.steps == budget and start % kept == 0  # a kept checkpoint
            assert branch.train.init_from == str(nope_budgets.workdir(tmp_path, run, top))
            assert budget - start == nope_budgets.cooldown(sweep, budget)
            # the branch is the stable run but for where its cooldown starts (learning rates
            # below); the schedule is the same for every run, so it is checked on the first
            assert branch.optim == stable.optim.replace(cooldown_steps=budget - start)
            assert branch.model_dump(exclude={"train", "optim"}) == stable.model_dump(
                exclude={"train", "optim"}
            )

    stable = planned[0][1][top]
    stable_lr = make_schedule(stable.optim, top)
    for budget in sweep.steps[:-1]:
        branch = planned[0][1][budget]
        start = branch.train.init_step
        lr = make_schedule(branch.optim, budget)
        steps = np.arange(start + 1)
        # up to the branch point the branch is the stable run (same learning rates) ...
        np.testing.assert_allclose(np.asarray(lr(steps)), np.asarray(stable_lr(steps)), rtol=1e-6)
        # ... and it ends decayed, as a finished schedule does
        assert float(lr(budget)) < 0.2 * float(lr(start))


def test_gaps_are_treatment_minus_reference_per_seed_and_budget_with_the_interaction():
    study = nope_budgets.load_sweep(SPEC)
    sweep = study.experiments.budgets
    rows = [
        BudgetRun(arch=a, variant=v, seed=s, budget=b, val_loss=loss)
        for a, base in (("causal_decoder", 1.0), ("noncausal_decoder", 2.0))
        for v, extra in (("rope", 0.0), ("nope", 0.1 if a == "causal_decoder" else 0.5))
        for s in (0, 1)
        for b in (125, 250)
        for loss in [base + extra + 0.01 * s + 1.0 / b]
    ]
    gaps = nope_budgets.gaps_by_budget(sweep, rows)
    assert gaps["causal_decoder"][(1, 250)] == pytest.approx(0.1)
    assert gaps["noncausal_decoder"][(0, 125)] == pytest.approx(0.5)
    assert gaps["noncausal_decoder - causal_decoder"][(1, 125)] == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("experiments.budgets.steps=[500,250]", "increasing order"),
        ("experiments.budgets.treatment=alibi", "not a variant of the study"),
        ("experiments.budgets.interaction=[causal_decoder]", "names two architectures"),
    ],
)
def test_a_bad_sweep_is_refused_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        nope_budgets.load_sweep(SPEC, [override])
    assert "\n" not in str(e.value)


def test_budgets_off_the_steps_per_call_grid_are_refused(tmp_path):
    study = nope_budgets.load_sweep(SPEC, ["experiments.budgets.steps=[123,1000]"])
    with pytest.raises(ConfigError, match=r"multiples of train\.steps_per_call"):
        nope_budgets.plan_budget_runs(study, SPEC.parent, tmp_path)


def test_the_command_trains_each_budget_once_and_reports_the_calls(tmp_path, monkeypatch, capsys):
    """The command end to end with the trainer replaced by a stand-in whose losses have a
    known gap: NoPE costs the non-causal decoder 0.5 at every budget and the causal one 0.2 at
    125 steps, halving per doubling. A second invocation trains nothing."""
    from scalestudy.train import loop
    from scalestudy.train.rundir import layout as rundir

    trained = []

    def fake_train(cfg, workdir):
        steps, arch, seed = cfg.train.steps, cfg.model.arch, cfg.train.seed
        nope = cfg.model.position == "none"
        gap = 0.5 if arch == "noncausal_decoder" else 0.2 * 125 / steps
        wobble = 0.002 * ((seed * 31 + steps) % 7 - 3) / 3  # differs by seed and budget
        loss = 0.42 + 0.01 * seed + (gap + wobble if nope else 0.0)
        assert (cfg.train.init_from is None) == (steps == 1000)
        trained.append((arch, nope, seed, steps))
        summary = {"final_val_loss": loss, "steps": steps, "complete": True, "wall_time_s": 1.0}
        workdir.mkdir(parents=True)
        rundir.write_summary(workdir, summary)
        return summary

    monkeypatch.setattr(loop, "train", fake_train)
    monkeypatch.setattr(order_floor, "validation_floor", lambda cfg: 0.41)  # tested on its own
    monkeypatch.setattr(order_floor, "validation_bag_floor", lambda cfg: 0.81)
    args = ["--spec", str(SPEC), "--out", str(tmp_path), "seeds=[0,1,2]"]
    assert nope_budgets.main(args) == 0
    assert len(trained) == 2 * 2 * 3 * 4 == len(set(trained))
    report = (tmp_path / nope_budgets.REPORT_NAME).read_text()
    sections = report.split("## ")
    noncausal = next(s for s in sections if s.startswith("noncausal_decoder\n"))
    causal = next(s for s in sections if s.startswith("causal_decoder\n"))
    assert "a final-loss effect" in noncausal and "optimisation-speed effect" in causal
    assert "Bag floor" in report
    assert nope_budgets.main(args) == 0 and len(trained) == 48  # nothing trained again


def test_the_proved_floor_is_the_bag_floor_above_the_references_last_loss():
    from scalestudy.study.plan.spec import BudgetSweepConfig

    sweep = BudgetSweepConfig(steps=[10, 20], reference="rope", treatment="nope")

    def row(arch, variant, seed, budget, loss, bag=None, position="none"):
        return BudgetRun(arch=arch, variant=variant, seed=seed, budget=budget,
                         val_loss=loss, bag_floor=bag, position=position)  # fmt: skip

    rows = [
        row("noncausal_decoder", "rope", 0, 20, 0.30, bag=0.9, position="rope"),
        row("noncausal_decoder", "rope", 1, 20, 0.40, bag=0.8, position="rope"),
        row("noncausal_decoder", "rope", 1, 10, 0.70, bag=0.8, position="rope"),
        row("noncausal_decoder", "nope", 0, 20, 1.2, bag=0.9),
        row("noncausal_decoder", "nope", 1, 20, 1.3, bag=0.8),
        row("causal_decoder", "rope", 0, 20, 0.3, position="rope"),  # no bag floor: no bound
        row("causal_decoder", "nope", 0, 20, 0.5),
    ]
    # the least over seeds of bag floor - the reference's loss at the largest budget
    assert nope_budgets.proved_floors(sweep, rows) == {"noncausal_decoder": pytest.approx(0.4)}
    # a treatment that reads positions has no bag floor to bound it
    moved = [replace(r, position="rope") if r.variant == "nope" else r for r in rows]
    assert nope_budgets.proved_floors(sweep, moved) == {}
