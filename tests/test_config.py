"""Config loading, overrides, includes and validation errors."""

from pathlib import Path

import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import VALID_CELLS, ExperimentConfig, load_config, to_yaml
from scalestudy.config.yamlio import apply_overrides, read_yaml

# (overrides, words the error message must contain): each a distinct way to get a config wrong.
BAD_INPUTS = [
    (["model.d_modl=64"], ["model.d_modl", "d_model"]),  # typo, with a suggestion
    (["modle.d_model=64"], ["modle", "model"]),  # unknown section
    (["model.d_model=abc"], ["model.d_model", "abc"]),  # wrong type
    (["model.d_model=12.5"], ["model.d_model", "12.5"]),  # float for int
    (["model.d_model=0"], ["model.d_model", "greater than or equal"]),
    (["model.n_heads=3"], ["n_heads=3", "d_model=64", "d_kv"]),  # heads do not divide width
    (["model.arch=transformer"], ["model.arch", "causal_decoder"]),
    (["model.arch=encoder_decoder"], ["flm", "encoder_decoder", "Valid cells"]),
    (["model.arch=noncausal_decoder"], ["flm", "noncausal_decoder", "Valid cells"]),
    (["model.n_encoder_layers=2"], ["n_encoder_layers", "encoder_decoder"]),
    (["model.position=alibi"], ["model.position", "rope"]),
    (["model.position=rope", "model.d_kv=7"], ["rope", "head_dim=7"]),
    (["model.dropout=1.0"], ["model.dropout", "less than 1"]),
    (["model.tie_embeddings=maybe"], ["model.tie_embeddings", "maybe"]),
    (["mesh.data=-1", "mesh.fsdp=-1"], ["at most one mesh axis", "-1"]),
    (["mesh.tensor=0"], ["mesh sizes", "tensor"]),
    (["mesh.fsdp=-2"], ["mesh sizes", "-2"]),
    (["train.microbatches=3"], ["train.microbatches=3", "batch_size=8"]),
    (["train.steps=0"], ["train.steps"]),
    (["optim.name=sgd"], ["optim.name", "adamw", "adafactor"]),
    (["optim.schedule=step"], ["optim.schedule", "wsd"]),
    (["optim.learning_rate=-1"], ["optim.learning_rate", "greater than 0"]),
    (["objective.name=clm"], ["objective.name", "flm"]),
    (["objective.noise_density=1.5"], ["objective.noise_density"]),
    (["objective.name=mlm", "data.extra_ids=0"], ["extra_ids", "sentinel"]),
    (["data.source=text"], ["data.paths", "empty"]),
    (["data.source=tfds"], ["data.tfds_name", "c4/en"]),
    (["data.vocab=sentencepiece"], ["data.spm_path", "vocab train"]),
    (["data.source=hub"], ["data.source", "synthetic"]),
    (["model.d_model"], ["key.sub=value"]),  # malformed override
    (["model..d_model=3"], ["key.sub=value"]),
    (["eval.batch_size=0"], ["eval.batch_size"]),
]


@pytest.mark.parametrize("overrides,words", BAD_INPUTS, ids=lambda x: str(x))
def test_bad_inputs_name_key_and_accepted_values(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_bad_inputs_are_distinct_and_numerous():
    assert len({tuple(o) for o, _ in BAD_INPUTS}) == len(BAD_INPUTS) >= 20


def test_overrides_parse_yaml_scalars_and_lists():
    cfg = load_config(
        None,
        ["model.d_model=128", "optim.learning_rate=3e-4", "data.source=text", "data.paths=[a, b]"],
    )
    assert cfg.model.d_model == 128
    assert cfg.optim.learning_rate == pytest.approx(3e-4)
    assert cfg.data.paths == ("a", "b")
    assert apply_overrides({"a": {"b": 1, "c": 2}}, ["a.b=3"]) == {"a": {"b": 3, "c": 2}}
    # YAML syntax as a value is the text itself; only YAML's null words clear a setting.
    assert apply_overrides({}, ["data.delimiter=---"]) == {"data": {"delimiter": "---"}}
    assert apply_overrides({}, ["a=#x", "b=null", "c=~"]) == {"a": "#x", "b": None, "c": None}


def test_a_list_key_takes_a_comma_list_as_members_do_and_a_scalar_key_keeps_its_comma():
    # `--members seed=0,1,2` writes a list with commas; an override of a list-typed key does too.
    flow = load_config(None, ["eval.num_fewshot=[0, 2]", "eval.tasks=[copa, piqa]"])
    commas = load_config(None, ["eval.num_fewshot=0,2", "eval.tasks=copa, piqa"])
    assert commas.eval.num_fewshot == flow.eval.num_fewshot == (0, 2)
    assert commas.eval.tasks == flow.eval.tasks == ("copa", "piqa")
    # A mapping's list values, and a lone value of a list key (a list of one).
    cfg = load_config(None, ["eval.num_fewshot_per_task.copa=1,4", "eval.tasks=copa"])
    assert cfg.eval.num_fewshot_per_task == {"copa": (1, 4)} and cfg.eval.tasks == ("copa",)
    # Each item is read as YAML: numbers stay numbers.
    assert apply_overrides({}, ["eval.num_fewshot=0,1"], ExperimentConfig) == {
        "eval": {"num_fewshot": [0, 1]}
    }
    # A text key keeps its comma; a quoted comma list stays one item.
    assert load_config(None, ["data.delimiter=a,b"]).data.delimiter == "a,b"
    quoted = apply_overrides({}, ["eval.tasks='a,b'"], ExperimentConfig)
    assert quoted == {"eval": {"tasks": ["a,b"]}}
    with pytest.raises(ConfigError, match=r"eval.num_fewshot=0,,1: an empty item"):
        load_config(None, ["eval.num_fewshot=0,,1"])


def test_includes_merge_then_file_then_overrides(tmp_path: Path):
    (tmp_path / "base.yaml").write_text("model: {d_model: 96, n_heads: 4}\ntrain: {steps: 7}\n")
    (tmp_path / "exp.yaml").write_text("include: [base.yaml]\nmodel: {n_layers: 3}\n")
    cfg = load_config(tmp_path / "exp.yaml", ["train.steps=9"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.train.steps) == (96, 3, 9)


def test_include_cycle_and_missing_file_are_errors(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_yaml_round_trip_and_stable_hash():
    cfg = load_config(None, ["model.d_model=32", "objective.name=plm"])
    again = load_config(None, ["objective.name=plm", "model.d_model=32"])
    assert cfg == again and cfg.hash() == again.hash()
    assert load_config(None, ["model.d_model=48"]).hash() != cfg.hash()
    import yaml

    assert ExperimentConfig.model_validate(yaml.safe_load(to_yaml(cfg))) == cfg


def test_every_valid_cell_loads_and_configs_are_frozen():
    for arch, objectives in VALID_CELLS.items():
        for objective in objectives:
            cfg = load_config(None, [f"model.arch={arch}", f"objective.name={objective}"])
            assert (cfg.model.arch, cfg.objective.name) == (arch, objective)
    with pytest.raises(Exception, match="frozen"):
        cfg.model.d_model = 3  # type: ignore[misc]


def test_derived_properties():
    cfg = load_config(None, ["model.d_model=64", "model.n_heads=4"])
    assert cfg.model.head_dim == 16
    t5 = load_config(None, ["model.d_model=512", "model.n_heads=6", "model.d_kv=64"])
    assert t5.model.head_dim == 64
    assert cfg.objective.decoder_length == cfg.objective.inputs_length + 16


def test_scientific_notation_without_a_dot_is_a_float(tmp_path: Path):
    (tmp_path / "exp.yaml").write_text("optim: {learning_rate: 1e-3, eps: 1E-8}\n")
    cfg = load_config(tmp_path / "exp.yaml")
    assert cfg.optim.learning_rate == pytest.approx(1e-3) and cfg.optim.eps == pytest.approx(1e-8)


def _validate_any(path: Path) -> object:
    """Validate one file under configs/ as what its folder holds."""
    from scalestudy.config.eval_config import TaskConfig
    from scalestudy.config.yamlio import read_yaml, validate
    from scalestudy.study.run.main_job import load_study

    kind = path.relative_to(CONFIGS).parts[0]
    if kind == "studies" and "published" in path.parts:  # published numbers, not specs
        from scalestudy.study.plan.published import read_published

        return read_published(path)
    if kind == "studies":
        return load_study(path)
    if kind == "tasks":
        return validate(TaskConfig, read_yaml(path), str(path))
    if kind == "prompted" and path.name == "templates.yaml":
        return read_yaml(path)
    if kind == "prompted":
        from scalestudy.data.prompted import load_mixture

        return load_mixture(path)
    # models, mesh presets, experiments: complete experiment configs, whose eval tasks the
    # command line checks as it loads them
    from scalestudy.evaluate.tasks import check_names

    cfg = load_config(path)
    check_names(cfg.eval.tasks)
    return cfg


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(CONFIGS.rglob("*.yaml"))


def test_configs_folder_holds_only_known_kinds():
    kinds = {p.relative_to(CONFIGS).parts[0] for p in CONFIG_FILES}
    assert kinds == {"models", "mesh", "experiments", "studies", "tasks", "prompted"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_file_validates(path: Path):
    assert _validate_any(path) is not None


def test_yaml_merge_keys_may_override_but_a_repeated_key_is_an_error(tmp_path):
    """`<<: *anchor` then a key of the anchor is an override, not a repeat; the same key
    twice in one mapping is refused (YAML would silently keep the last)."""
    ok = tmp_path / "ok.yaml"
    ok.write_text("x: &m {d_model: 64, n_heads: 4}\nmodel:\n  <<: *m\n  d_model: 128\n")
    assert read_yaml(ok)["model"] == {"d_model": 128, "n_heads": 4}
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: 64\n  n_layers: 2\n  d_model: 128\n")
    with pytest.raises(ConfigError, match=r"'d_model' is given twice .*lines 2 and 4"):
        read_yaml(bad)


@pytest.mark.parametrize("tasks", ["[1,2]", "[[synthetic_probes]]", "['']"])
def test_task_entries_that_are_not_names_are_refused_when_the_config_loads(tasks):
    with pytest.raises(ConfigError, match=r"eval.tasks holds .*each entry is a task name"):
        load_config(None, [f"eval.tasks={tasks}"])
