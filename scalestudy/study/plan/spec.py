"""A study spec (configs/studies/*.yaml): the ladder, budgets, cells, seeds, fits, launchers.

`study/run/main_job.py` expands a spec in code into ExperimentConfigs, one per (cell, size, budget
point, seed).

Kept whole: the spec's schema, one model per section, and the checks of each section against
the others that pydantic runs as the spec is read (the cross-file checks are
study/plan/spec_checks.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from scalestudy.config.base import Count, Frozen, Tuple, parse_count
from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import (
    ARCHS,
    MAX_SEED,
    OBJECTIVES,
    ModelConfig,
    check_cell,
)
from scalestudy.study.plan import groups
from scalestudy.study.plan.launch_spec import SlurmConfig, TpuConfig
from scalestudy.study.plan.stages_spec import StagesSpec

MatchingMode = Literal[
    "equal_total_params",
    "equal_stack_shape",
    "equal_flops",
    "equal_documents",
    "equal_loss_tokens",
    "equal_inference_cost",
]  # study/plan/matching.py
DATA_MODES = ("equal_documents", "equal_loss_tokens")  # the modes `match_by: batch` applies to


class LadderConfig(Frozen):
    """Model sizes of a study: a named preset, target sizes, or explicit shapes.

    `sizes` entries are rung names ('1M', '30M'), target non-embedding parameter counts of a
    decoder stack (2e6), model preset YAML files (relative to the spec), or mappings of
    ModelConfig keys with a `name`. Shapes for targets come from study/plan/ladder.py's rule.
    """

    preset: str | None = None
    sizes: Tuple = ()
    head_dim: int = Field(64, ge=4)  # per-head width once d_model reaches 4 * head_dim
    ff_multiplier: float = Field(8 / 3, gt=0.0)  # d_ff / d_model (gated MLP: 8/3 keeps 12 d^2)
    aspect_small: float = Field(16.0, gt=0.0)  # d_model / n_layers at 1e5 parameters
    aspect_large: float = Field(128.0, gt=0.0)  # ... at 1e11 parameters (log-linear between)
    min_layers: int = Field(2, ge=1)
    # Peak learning rate per rung: "inverse_width" scales optim.learning_rate by
    # lr_reference_width / d_model (wider models take smaller Adam steps, as in muP).
    lr_scaling: Literal["none", "inverse_width"] = "none"
    lr_reference_width: int = Field(256, ge=1)
    # Cells that train at only some of the sizes: {"arch/objective": [size name, ...]}; a
    # cell not listed trains at every size (study/run/main_job.py checks the names).
    cell_sizes: dict[str, Tuple] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> LadderConfig:
        if self.preset is None and not self.sizes:
            raise ConfigError(
                "ladder: give a preset (e.g. ladder.preset=smoke) or a list of ladder.sizes"
            )
        if self.preset is not None and self.sizes:
            raise ConfigError(
                f"ladder: give a preset or sizes, not both (preset {self.preset!r} would be "
                "ignored); to use part of a preset, list its sizes under ladder.sizes (over a "
                "spec with a preset, add ladder.preset=null)"
            )
        for entry in self.sizes:
            if isinstance(entry, dict):
                _check_name("ladder.sizes[].name", entry.get("name"))
                given = sorted({"arch", "n_encoder_layers"} & set(entry))
                if given:
                    raise ConfigError(
                        f"ladder.sizes[{entry.get('name')}]: {given} are set by each cell "
                        "(its architecture and matching), not by a size; drop them"
                    )
        for cell, names in self.cell_sizes.items():
            if cell.count("/") != 1 or not names:
                raise ConfigError(
                    f"ladder.cell_sizes: each key is 'arch/objective' with a non-empty list of "
                    f"size names; got {cell!r}: {list(names)!r}"
                )
        return self


def _check_name(key: str, name: Any) -> None:
    """A study or size name becomes part of run directory names: no path separators, no
    leading dot (`../x` would write outside the study's directory)."""
    if isinstance(name, str) and ("/" in name or "\\" in name or name.startswith(".")):
        raise ConfigError(
            f"{key}: {name!r} is not accepted; names become directory names, so no '/', "
            "'\\' or leading '.'"
        )


class BudgetConfig(Frozen):
    """How long each run trains: fixed steps, fixed tokens, tokens per parameter, or IsoFLOP.

    Tokens are processed positions (decoder positions, plus encoder positions for the
    encoder-decoder), so every architecture sees the same text for the same budget.
    """

    kind: Literal["steps", "tokens", "tokens_per_param", "isoflop"] = "steps"
    steps: int | None = Field(None, ge=1)
    # kind steps: some sizes' own step counts ({size: steps}; the others train `steps`), so a
    # ladder can hold tokens per parameter within a stated factor while it spans a wide range
    # of sizes (study/run/main_job.py checks the names against the ladder).
    steps_per_size: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    tokens: Count | None = None
    # Chinchilla's ratio is 20 tokens per parameter counting *every* parameter; `param_kind`
    # says which count this ratio multiplies (the report states the tokens per both counts).
    tokens_per_param: float = Field(20.0, gt=0.0)
    param_kind: Literal["total", "non_embedding"] = "non_embedding"
    compute: Tuple = ()  # isoflop: training FLOPs budgets, e.g. [1e15, 3e15]
    min_steps: int = Field(10, ge=1)  # isoflop: drop (size, budget) points shorter than this

    @field_validator("steps_per_size", mode="before")
    @classmethod
    def _null_is_none(cls, value: Any) -> Any:
        """`steps_per_size: null` clears what an included spec gave."""
        return {} if value is None else value

    @model_validator(mode="after")
    def _check(self) -> BudgetConfig:
        need = {"steps": self.steps, "tokens": self.tokens}.get(self.kind, True)
        if need is None:
            raise ConfigError(f"budget.kind={self.kind!r} needs budget.{self.kind} to be set")
        if self.steps_per_size and self.kind != "steps":
            raise ConfigError(
                f"budget.steps_per_size is for budget.kind='steps' (got kind {self.kind!r}); "
                "give every size's steps there, or drop steps_per_size"
            )
        if self.kind == "isoflop":
            if not self.compute:
                raise ConfigError("budget.kind='isoflop' needs budget.compute: a list of FLOPs")
            for c in self.compute:
                if not isinstance(parse_count(c), int | float) or parse_count(c) <= 0:
                    raise ConfigError(f"budget.compute: {c!r} is not a positive FLOP count")
        return self

    def for_size(self, size: str) -> BudgetConfig:
        """This budget as the size `size` trains it (its own steps where given)."""
        if size not in self.steps_per_size:
            return self
        return self.model_copy(update={"steps": self.steps_per_size[size]})


class RepeatSeedsConfig(Frozen):
    """Seeds trained only at some sizes, beside `seeds` (which every size trains): run-to-run
    variation measured where runs are cheap, so a fit's `seed` flag has repeats to go on
    without repeating the costly sizes."""

    seeds: Tuple = ()
    sizes: Tuple = ()  # size names of the ladder (study/run/main_job.py checks them)

    @model_validator(mode="after")
    def _check(self) -> RepeatSeedsConfig:
        if bool(self.seeds) != bool(self.sizes):
            raise ConfigError(
                "repeat_seeds: give both seeds (a list of integers) and sizes (ladder size "
                f"names), or neither; got seeds={list(self.seeds)}, sizes={list(self.sizes)}"
            )
        if not all(isinstance(s, int) for s in self.seeds):
            raise ConfigError(f"repeat_seeds.seeds: a list of integers; got {list(self.seeds)!r}")
        _check_unique("repeat_seeds.seeds", list(self.seeds))
        return self


class LrSearchConfig(Frozen):
    """Peak learning rates tried before the study's runs train (study/run/lr_search.py): at each
    searched size every cell trains the search's own seed once per rate, and the rate with
    the lowest validation loss (the training corpus's held-out split) is the one its runs
    train at; a choice at an end of the rates tried adds one rate beyond it, `extensions`
    times at most."""

    # Values of `optim.learning_rate`, each passed through the ladder's `lr_scaling` rule.
    rates: Annotated[tuple[float, ...], Field(strict=False, min_length=2)]
    sizes: Tuple = ()  # the sizes searched (others take the nearest one's); empty: every size
    # The search's runs train this seed, never a scored one (StudySpec refuses a clash), so
    # a choice made on them cannot favour the runs the verdicts compare.
    seed: int = Field(1000, ge=0, le=MAX_SEED)
    extensions: int = Field(2, ge=0)  # most rates added beyond an end, per searched point

    @model_validator(mode="after")
    def _check(self) -> LrSearchConfig:
        if any(not r > 0 for r in self.rates):
            raise ConfigError(f"lr_search.rates: positive numbers; got {list(self.rates)}")
        _check_unique("lr_search.rates", list(self.rates))
        return self


class FitConfig(Frozen):
    """Scaling-law fits run at the end of a study (scalestudy.scaling)."""

    laws: Tuple = ("kaplan_n", "chinchilla3")
    n_kind: Literal["total", "non_embedding", "active"] = "non_embedding"
    c_kind: Literal["6nd", "counted"] = "counted"
    bootstrap: int = Field(200, ge=0)  # resamples of runs: the loss laws' intervals and flags
    task_bootstrap: int | None = Field(None, ge=0)  # the task laws' (each refits two steps)
    seed: int = 0


class VariantConfig(Frozen):
    """A named variant of a study's cells: ModelConfig keys set over each matched model (e.g.
    `position: rope`), optionally its own matching mode, optionally only for some cells."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    model: dict = Field(default_factory=dict)
    matching: MatchingMode | None = None  # None: the study's
    cells: Tuple = ()  # [[arch, objective], ...] it applies to; empty: every cell of the study

    @model_validator(mode="after")
    def _check(self) -> VariantConfig:
        allowed = [k for k in ModelConfig.model_fields if k != "arch"]  # cells set the arch
        unknown = sorted(set(self.model) - set(allowed))
        if unknown:
            raise ConfigError(
                f"variants[{self.name}].model: cannot set {unknown}; accepted keys: "
                f"{', '.join(allowed)}"
            )
        for cell in self.cells:
            if not isinstance(cell, list | tuple) or len(cell) != 2:
                raise ConfigError(
                    f"variants[{self.name}].cells: each entry is [arch, objective]; got {cell!r}"
                )
            check_cell(*cell)
        return self


class ComparisonConfig(Frozen):
    """One claim of the decoder-only report: groups of runs compared on validation loss and
    probe accuracy, each group named "arch/objective" or "arch/objective/variant"."""

    title: str
    question: str = ""
    groups: Tuple  # the first is the reference the others are compared with
    # pairwise: every group against the first. interaction: four groups [A, A', B, B'], testing
    # whether the change A -> A' does the same as B -> B' (the difference of differences,
    # paired by seed): e.g. does NoPE hurt the non-causal decoder more than the causal one.
    kind: Literal["pairwise", "interaction"] = "pairwise"
    # Also compare validation losses at this fraction of training (the last evaluation at or
    # before it), to tell a difference in optimisation speed from one in final loss.
    also_at: float | None = Field(None, gt=0.0, lt=1.0)
    # What pairwise comparisons test: validation loss and/or probe accuracy (e.g. loss alone
    # where the probes do not bear on the training corpus; every test joins the Holm family).
    metrics: Annotated[tuple[Literal["loss", "acc"], ...], Field(min_length=1, strict=False)] = (
        "loss",
        "acc",
    )

    @model_validator(mode="after")
    def _check(self) -> ComparisonConfig:
        if self.kind == "interaction" and len(self.groups) != 4:
            raise ConfigError(
                f"comparison {self.title!r}: kind 'interaction' needs four groups [A, A', B, "
                f"B'], got {len(self.groups)}"
            )
        return self


class InferenceCostConfig(Frozen):
    """Multi-turn inference cost: a dialogue of `turns` turns, each a user message of
    `user_tokens` then a greedy reply of `reply_tokens`, timed on this host."""

    turns: int = Field(8, ge=1)
    user_tokens: int = Field(32, ge=1)
    reply_tokens: int = Field(16, ge=1)
    rows: int = Field(1, ge=1)  # dialogues decoded together
    repeats: int = Field(5, ge=1)  # timings per turn; the fastest is reported
    # ModelConfig keys over the study's largest rung (e.g. a wider model).
    model: dict = Field(default_factory=dict)


class RankOverTrainingConfig(Frozen):
    """Attention-rank probes on every kept checkpoint of the first seed of some groups."""

    groups: Tuple
    examples: int = Field(8, ge=1)


class BudgetSweepConfig(Frozen):
    """A variant against a reference at several budgets, each a finished schedule: one
    warmup-stable-decay run per run of the study, cooldown branches for the smaller budgets
    (decoder_only/nope_budgets.py)."""

    steps: Annotated[tuple[int, ...], Field(strict=False, min_length=2)]  # increasing
    cooldown_fraction: float = Field(0.2, gt=0.0, lt=1.0)  # of each budget
    reference: str  # variant names
    treatment: str
    interaction: Annotated[tuple[str, ...], Field(strict=False)] = ()  # (A, B): B's gap - A's


class DecoderOnlyConfig(Frozen):
    """The "why decoder-only" experiments run after a study's training (decoder_only/)."""

    inference: InferenceCostConfig | None = None
    comparisons: Annotated[tuple[ComparisonConfig, ...], Field(strict=False)] = ()
    rank: RankOverTrainingConfig | None = None
    budgets: BudgetSweepConfig | None = None


class StudySpec(Frozen):
    """A whole study: base experiment, grid axes, sizes, budgets, matching, evaluation, fits."""

    name: str
    description: str = ""
    # Experiment YAML file(s), relative to the spec file, merged in order.
    base_config: Annotated[tuple, BeforeValidator(lambda v: (v,) if isinstance(v, str) else v)] = (
        Field(default=(), strict=False)
    )
    # Inline ExperimentConfig keys, merged over base_config.
    base: dict = Field(default_factory=dict)
    # ExperimentConfig keys merged over `base` for one cell's runs: {"arch/objective": {...}};
    # a spec states why each cell differs (study/run/main_job.py checks the cell names).
    cell_base: dict[str, dict] = Field(default_factory=dict)
    archs: Tuple = ARCHS
    objectives: Tuple = OBJECTIVES
    cells: Tuple = ()  # [[arch, objective], ...]; empty: every valid cell of archs x objectives
    ladder: LadderConfig
    budget: BudgetConfig = BudgetConfig(kind="steps", steps=100)
    matching: MatchingMode = "equal_stack_shape"
    # What a data matching (equal_documents, equal_loss_tokens) changes: a cell's steps, or
    # its batch rows at the reference's steps (study/plan/matching.py).
    match_by: Literal["steps", "batch"] = "steps"
    match_tolerance: float = Field(0.03, gt=0.0, lt=1.0)  # equal_total_params: relative
    # Context (tokens) inference cost is stated at; None: the objective's decoder length.
    inference_context: int | None = Field(None, ge=1)
    seeds: Tuple = (0,)
    repeat_seeds: RepeatSeedsConfig = Field(default_factory=RepeatSeedsConfig)  # few sizes
    # Named variants (model-key overrides) of the cells; empty: each cell once, unchanged.
    variants: Annotated[tuple[VariantConfig, ...], Field(strict=False)] = ()
    experiments: DecoderOnlyConfig | None = None  # the decoder-only report's experiments
    tasks: Tuple = ()  # evaluation tasks; empty: base eval.tasks
    fit: FitConfig = FitConfig()
    slurm: SlurmConfig = SlurmConfig()
    tpu: TpuConfig = TpuConfig()
    stages: StagesSpec | None = None  # adaptation and finetuning after pretraining
    lr_search: LrSearchConfig | None = None  # rates chosen on held-out text first
    # Runs that differ only in seeds or optimizer numbers train as members of one program
    # (study/plan/groups.py): "auto" (up to 8 per group), a most per group, or 1 (each alone).
    members: Literal["auto"] | int = "auto"

    @model_validator(mode="before")
    @classmethod
    def _one_grid(cls, data: Any) -> Any:
        """`cells` names the grid itself: archs or objectives beside it would be ignored."""
        if isinstance(data, dict) and data.get("cells"):
            for key, default in (("archs", ARCHS), ("objectives", OBJECTIVES)):
                given = data.get(key)
                if given is not None and tuple(given) != tuple(default):
                    raise ConfigError(
                        f"{key} is given beside cells, which name the grid itself ({key} would "
                        f"be ignored); give cells: [[arch, objective], ...] or {key}, not both"
                    )
        return data

    @model_validator(mode="after")
    def _check(self) -> StudySpec:
        _check_name("name", self.name)
        for cell, changes in self.cell_base.items():
            fixed = [
                f"{section}.{key}"
                for section, key in (("model", "arch"), ("objective", "name"))
                if key in (changes.get(section) or {})
            ]
            if fixed:
                raise ConfigError(
                    f"cell_base[{cell}]: {fixed} would change the cell itself; a cell's "
                    "architecture and objective are its key ('arch/objective'): add that cell"
                )
        for arch in self.archs:
            if arch not in ARCHS:
                raise ConfigError(f"archs: got {arch!r}; accepted: {', '.join(ARCHS)}")
        for obj in self.objectives:
            if obj not in OBJECTIVES:
                raise ConfigError(f"objectives: got {obj!r}; accepted: {', '.join(OBJECTIVES)}")
        for cell in self.cells:
            if not isinstance(cell, list | tuple) or len(cell) != 2:
                raise ConfigError(f"cells: each entry is [arch, objective]; got {cell!r}")
            check_cell(*cell)
        for key, values in (
            ("cells", [tuple(c) for c in self.cells]),
            ("archs", list(self.archs)),
            ("objectives", list(self.objectives)),
        ):
            _check_unique(key, values)
        if not self.seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED
            for s in self.seeds
        ):
            raise ConfigError(
                f"seeds: a non-empty list of whole numbers from 0 to {MAX_SEED}; got {self.seeds!r}"
            )
        _check_unique("seeds", list(self.seeds))
        both = set(self.seeds) & set(self.repeat_seeds.seeds)
        if both:
            raise ConfigError(
                f"repeat_seeds.seeds: {sorted(both)} already in seeds (every size trains those)"
            )
        if self.lr_search and self.lr_search.seed in (*self.seeds, *self.repeat_seeds.seeds):
            raise ConfigError(
                f"lr_search.seed: {self.lr_search.seed} is one of the study's scored seeds "
                f"(seeds {list(self.seeds)}, repeat_seeds {list(self.repeat_seeds.seeds)}); the "
                "search trains a seed of its own: give one outside them"
            )
        if self.members != "auto":
            groups.cap(self.members)  # an error naming the accepted values
        if self.match_by == "batch" and self.matching not in DATA_MODES:
            raise ConfigError(
                f"match_by: batch changes a cell's batch rows to match data per step; it needs "
                f"matching {' or '.join(DATA_MODES)} (got {self.matching}); use match_by: steps"
            )
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ConfigError(f"variants: names must be unique; got {names}")
        return self


def _check_unique(key: str, values: list) -> None:
    """Raise ConfigError naming the entries of a spec list that appear more than once (each
    would plan the same runs twice, into one run directory)."""
    twice = [v for i, v in enumerate(values) if v in values[:i]]
    if twice:
        shown = ", ".join(str(list(v)) if isinstance(v, tuple) else repr(v) for v in twice)
        raise ConfigError(f"{key}: {shown} given more than once; list each once")
