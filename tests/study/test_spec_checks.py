"""Spec mistakes that the stages and experiments after pretraining would meet only then are
refused when the spec is read or expanded: one `error:` line from `study --dry-run`, and a
real study trains nothing first."""

import re
from pathlib import Path

import pytest

from scalestudy.cli.main import main
from scalestudy.config.errors import ConfigError
from scalestudy.study.run import main_job

from .conftest import TINY_BASE, write_spec

REPO = Path(__file__).resolve().parents[2]
MIXTURE = REPO / "configs" / "prompted" / "synthetic_smoke.yaml"
VARIANTS = [{"name": "rope", "model": {"position": "rope"}}, {"name": "nope"}]
FINETUNE = {
    "mixture": str(MIXTURE),
    "steps": 2,
    "batch_size": 4,
    "inputs_length": 24,
    "targets_length": 8,
    "eval_tasks": ["synthetic_probes"],
}


def _base(**model):
    return {**TINY_BASE, "model": {**TINY_BASE["model"], **model}}


def _budgets(**changes):
    return {"budgets": {"steps": [2, 4], "reference": "rope", "treatment": "nope", **changes}}


def _adapt(buckets):
    """Causal FLM adapted to the non-causal decoder under relative position bias."""
    return {
        "base": _base(position="relative_bias", rel_prefix_buckets=buckets),
        "stages": {
            "adapt": [
                {
                    "from_cell": ["causal_decoder", "flm"],
                    "arch": "noncausal_decoder",
                    "objective": "plm",
                    "fraction": 0.5,
                }
            ]
        },
    }


# (spec changes, the error's pattern): each was accepted by `--dry-run` with exit 0.
CASES = {
    "adapt from a missing cell": (
        {"stages": {"adapt": [{"from_cell": ["noncausal_decoder", "mlm"], "objective": "flm"}]}},
        r"stages\.adapt\[0\]\.from_cell: \['noncausal_decoder', 'mlm'\] is not a cell of the "
        r"study; accepted: \[causal_decoder, flm\], \[encoder_decoder, mlm\]",
    ),
    "budgets decreasing": (
        {"variants": VARIANTS, "experiments": _budgets(steps=[10, 5])},
        r"experiments\.budgets\.steps: positive step counts in increasing order.*\[10, 5\]",
    ),
    "budgets repeated": (
        {"variants": VARIANTS, "experiments": _budgets(steps=[5, 5])},
        r"experiments\.budgets\.steps: .*\[5, 5\]",
    ),
    "budgets not positive": (
        {"variants": VARIANTS, "experiments": _budgets(steps=[0, 5])},
        r"experiments\.budgets\.steps: .*\[0, 5\]",
    ),
    "budgets interaction of one": (
        {"variants": VARIANTS, "experiments": _budgets(interaction=["causal_decoder"])},
        r"experiments\.budgets\.interaction names two architectures",
    ),
    "budgets reference unknown": (
        {"variants": VARIANTS, "experiments": _budgets(reference="ghost")},
        r"experiments\.budgets\.reference='ghost' is not a variant of the study; "
        r"accepted: rope, nope",
    ),
    "budgets treatment without variants": (
        {"experiments": _budgets()},
        r"experiments\.budgets\.reference='rope' is not a variant of the study; accepted: none",
    ),
    "rank group malformed": (
        {"experiments": {"rank": {"groups": ["x/y/z"]}}},
        r"experiments\.rank\.groups: \['x/y/z'\] are not groups of the study; accepted: "
        r"causal_decoder/flm, encoder_decoder/mlm",
    ),
    "rank group of another cell": (
        {"experiments": {"rank": {"groups": ["causal_decoder/flm", "causal_decoder/plm"]}}},
        r"experiments\.rank\.groups: \['causal_decoder/plm'\]",
    ),
    "comparison group of no variant": (
        {
            "experiments": {
                "comparisons": [
                    {"title": "t", "groups": ["causal_decoder/flm", "causal_decoder/flm/nope"]}
                ]
            }
        },
        r"experiments\.comparisons\[0\]\.groups: \['causal_decoder/flm/nope'\] are not groups",
    ),
    "comparison group without its variant": (
        {
            "variants": VARIANTS,
            "experiments": {
                "comparisons": [
                    {"title": "t", "groups": ["causal_decoder/flm/rope", "causal_decoder/flm"]}
                ]
            },
        },
        r"experiments\.comparisons\[0\]\.groups: \['causal_decoder/flm'\] are not groups of the "
        r"study; accepted: causal_decoder/flm/rope, causal_decoder/flm/nope, ",
    ),
    "published file missing": (
        {"stages": {"published": "nope.yaml"}},
        r"stages\.published: the published numbers not found: .*nope\.yaml",
    ),
    "adapt with the mirrored bias": (
        _adapt("mirrored"),
        r"stages\.adapt\[0\] \(from causal_decoder/flm\): cannot adapt a causal_decoder run to "
        r"noncausal_decoder with model\.rel_prefix_buckets='mirrored'",
    ),
    "finetune evaluated on a trained task": (
        {"stages": {"finetune": {**FINETUNE, "eval_tasks": ["pronoun"]}}},
        r"stages\.finetune\.eval_tasks: evaluation tasks \['pronoun'\] are in the training "
        r"mixture 'synthetic_smoke' \(it trains \['next_number', 'pronoun'\]\)",
    ),
    "demonstrations for a task not scored": (
        {"base": {**TINY_BASE, "eval": {"num_fewshot_per_task": {"incontext_probe": [0, 2]}}}},
        r"base\.eval\.num_fewshot_per_task names 'incontext_probe', which is not a task the "
        r"study scores; accepted: synthetic_probes",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_mistake_is_refused_when_the_spec_is_expanded(tmp_path, case):
    changes, pattern = CASES[case]
    spec = write_spec(tmp_path / "spec.yaml", **changes)
    with pytest.raises(ConfigError, match=pattern) as e:
        main_job.expand(main_job.load_study(spec), spec.parent)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["adapt with the mirrored bias", "published file missing"])
def test_dry_run_says_one_error_line_and_writes_nothing(tmp_path, capsys, case):
    changes, pattern = CASES[case]
    spec = write_spec(tmp_path / "spec.yaml", **changes)
    out = tmp_path / "out"
    assert main(["study", "--spec", str(spec), "--out", str(out), "--dry-run"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(pattern, err[0]), err
    assert not out.exists()


@pytest.mark.parametrize(
    "case", ["adapt with the mirrored bias", "finetune evaluated on a trained task"]
)
def test_the_real_study_trains_nothing_first(tmp_path, case):
    """Both were refused by the stage itself, after every pretraining run had trained."""
    changes, pattern = CASES[case]
    spec = write_spec(tmp_path / "spec.yaml", **changes)
    trained = []
    with pytest.raises(ConfigError, match=pattern):
        main_job.run_study(
            spec, tmp_path / "out", train_fn=lambda cfg, workdir: trained.append(cfg)
        )
    assert trained == [] and not (tmp_path / "out").exists()


def test_only_the_mirrored_bias_layout_is_refused(tmp_path):
    """Wang et al.'s single table (rel_prefix_buckets=causal) keeps every parameter."""
    for buckets in ("causal", "mirrored"):
        spec = write_spec(tmp_path / f"{buckets}.yaml", **_adapt(buckets))
        study = main_job.load_study(spec)
        if buckets == "causal":
            assert main_job.expand(study, spec.parent)
        else:
            with pytest.raises(ConfigError, match="rel_prefix_buckets=causal"):
                main_job.expand(study, spec.parent)
