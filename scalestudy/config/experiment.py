"""Typed, frozen configs of one run: model, data, objective, optim, mesh, train, eval.

One pydantic model per concern and an `ExperimentConfig` that holds one of each. Every field
has a default, so any YAML file that sets a subset (a model preset, an experiment) is a
complete experiment. Validation happens here, at load time, before any JAX work: unknown keys,
wrong types and impossible values are `ConfigError`s that name the key, the value and what
would be accepted. The `data` section lives in `config/data_config.py`, the `eval` section and
tasks defined in YAML in `config/eval_config.py`, the frozen base model in `config/base.py`, reading
YAML (includes, overrides) in `config/yamlio.py` and a study's spec in `study/plan/spec.py`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal, get_args

import yaml
from pydantic import BaseModel, Field, model_validator

from scalestudy.config.base import Frozen

# The data section lives in its own module; its names stay importable from here.
from scalestudy.config.data_config import MAX_SEED as MAX_SEED
from scalestudy.config.data_config import DataConfig as DataConfig
from scalestudy.config.data_config import SyntheticConfig as SyntheticConfig
from scalestudy.config.errors import ConfigError
from scalestudy.config.eval_config import EvalConfig
from scalestudy.config.mesh_config import MeshConfig
from scalestudy.config.model_limits import MAX_DIM, check_param_sizes
from scalestudy.config.moe_config import MoEConfig
from scalestudy.config.yamlio import apply_overrides, read_yaml, validate

Arch = Literal["causal_decoder", "noncausal_decoder", "encoder_decoder"]
ObjectiveName = Literal["flm", "plm", "mlm", "bmlm"]
ARCHS: tuple[str, ...] = get_args(Arch)
# The objectives of the grid (a study's default). bmlm, BERT-style masked LM, is outside it: it
# trains only in the cells of EXTRA_CELLS, which a study names in its `cells`.
OBJECTIVES: tuple[str, ...] = ("flm", "plm", "mlm")

# The grid of Wang et al. (2022) plus the causal decoder trained on prefix-LM examples.
VALID_CELLS: dict[str, tuple[str, ...]] = {
    "causal_decoder": ("flm", "plm", "mlm"),
    "noncausal_decoder": ("plm", "mlm"),
    "encoder_decoder": ("plm", "mlm"),
}
EXTRA_CELLS: dict[str, tuple[str, ...]] = {"noncausal_decoder": ("bmlm",)}
INVALID_CELL_REASON = (
    "full language modeling (flm) has no inputs: every token is a target, so there is no "
    "prefix for a non-causal decoder to attend to bidirectionally and nothing for an encoder "
    "to read"
)
BMLM_CELL_REASON = (
    "BERT-style masked LM (bmlm) predicts masked tokens in place inside one bidirectional "
    "sequence, which only the non-causal decoder reads (its whole row bidirectional); a causal "
    "decoder sees nothing to the right of a masked token and an encoder-decoder has no "
    "in-place targets"
)


def check_cell(arch: str, objective: str) -> None:
    """Raise ConfigError unless (arch, objective) is a trainable cell of the grid."""
    if arch not in VALID_CELLS:
        raise ConfigError(f"model.arch: got {arch!r}; accepted: {', '.join(ARCHS)}")
    if objective not in get_args(ObjectiveName):  # a name first, then the pair
        raise ConfigError(
            f"objective.name: got {objective!r}; accepted: {', '.join(get_args(ObjectiveName))}"
        )
    if objective not in (*VALID_CELLS[arch], *EXTRA_CELLS.get(arch, ())):
        valid = {a: (*o, *EXTRA_CELLS.get(a, ())) for a, o in VALID_CELLS.items()}
        cells = "; ".join(f"{a}: {', '.join(o)}" for a, o in valid.items())
        reason = BMLM_CELL_REASON if objective == "bmlm" else INVALID_CELL_REASON
        raise ConfigError(
            f"objective.name={objective!r} with model.arch={arch!r} is not a valid cell: "
            f"{reason}. Valid cells are {cells}"
        )


class ModelConfig(Frozen):
    """Transformer shape and family options; T5.1.1 conventions by default."""

    arch: Arch = "causal_decoder"
    vocab_size: int = Field(384, ge=2, le=MAX_DIM)
    d_model: int = Field(64, ge=1, le=MAX_DIM)
    n_layers: int = Field(2, ge=1, le=MAX_DIM)  # decoder-only depth, or enc-dec's decoder
    n_encoder_layers: int | None = Field(None, ge=1, le=MAX_DIM)  # enc-dec; default n_layers
    n_heads: int = Field(4, ge=1, le=MAX_DIM)
    d_kv: int | None = Field(None, ge=1, le=MAX_DIM)  # per-head width; default d_model // n_heads
    d_ff: int = Field(256, ge=1, le=MAX_DIM)
    activation: Literal["gated_gelu", "gated_silu", "gelu", "relu"] = "gated_gelu"
    position: Literal["relative_bias", "rope", "none"] = "relative_bias"
    rel_buckets: int = Field(32, ge=2, le=MAX_DIM)
    rel_max_distance: int = Field(128, ge=2, le=MAX_DIM)
    # Relative-position buckets of the non-causal decoder (models/layers.py): "mirrored" tells
    # prefix pairs apart by direction (a second table half for the future); "causal" is T5X's
    # decoder-only model as Wang et al. (2022) ran it: one causal table, future keys in bucket
    # 0. Left out of dumps (and run ids) while "mirrored".
    rel_prefix_buckets: Literal["mirrored", "causal"] = Field(
        "mirrored", exclude_if=lambda v: v == "mirrored"
    )
    tie_embeddings: bool = False
    # "mixed": in bidirectional stacks, half the heads see only the past (forward) and half only
    # the future (backward). Causal stacks ignore it. "mixed_layers": the same split by layer
    # (even layers forward, odd layers backward) instead of by head.
    attention: Literal["standard", "mixed", "mixed_layers"] = "standard"
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Queries and keys RMS-normalised per head, each with a learnt scale [K], and the logits
    # scaled by 1/sqrt(K) (Dehghani et al. 2023; Wortsman et al. 2023): bounds the attention
    # logits, which lets small models train at higher learning rates. Left out of dumps (and
    # run ids) while off.
    qk_norm: bool = Field(False, exclude_if=lambda v: not v)
    dtype: Literal["float32", "bfloat16"] = "bfloat16"  # compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Run the layer stack as a `lax.scan` (True), unrolled (False), or "auto": unrolled on a
    # CPU up to models/decoder.py AUTO_UNROLL_MAX_LAYERS layers, scanned otherwise.
    scan_layers: bool | Literal["auto"] = "auto"
    # What the backward pass keeps per layer (models/decoder.py REMAT_POLICIES): none (keep
    # everything), full (keep nothing), minimal (only the residual stream), save_attention
    # (and attention outputs), save_attention_mlp (and MLP outputs), save_dots,
    # save_dots_no_batch (matmul outputs, all or only those without a batch dimension).
    remat: Literal[
        "none",
        "full",
        "minimal",
        "save_attention",
        "save_attention_mlp",
        "save_dots",
        "save_dots_no_batch",
    ] = "none"
    # Attention backend (models/attention.py): auto (per platform), xla (reference einsums),
    # cudnn (GPU flash attention), splash (TPU Pallas kernel). Left out of dumps (and so of
    # run ids) while "auto", so existing studies keep their ids.
    attention_impl: Literal["auto", "xla", "cudnn", "splash"] = Field(
        "auto", exclude_if=lambda v: v == "auto"
    )
    # Attention logits on the reference ("xla") path: compute (rounded to the compute dtype
    # before the float32 softmax, as T5X's and MaxText's default float32_logits=False and
    # nanodo do: half the memory traffic of the [B, H, L, S] logits; 1.29x faster steps at
    # 125M on an H100, docs/performance.md) or float32 (accumulated and kept in float32, as
    # cuDNN does). The same under a float32 compute dtype. Left out of dumps while "compute".
    attention_logits: Literal["compute", "float32"] = Field(
        "compute", exclude_if=lambda v: v == "compute"
    )
    # Counting convention: count causal attention score/value FLOPs at half (only the lower
    # triangle is needed). Off by default, as in Kaplan et al. and Chinchilla.
    halve_causal_attention_flops: bool = False
    # Mixture-of-experts feed-forward layers (config/moe_config.py, models/moe.py). Left out of
    # dumps (and run ids) while off.
    moe: MoEConfig = Field(MoEConfig(), exclude_if=lambda v: not v.enabled)

    @property
    def head_dim(self) -> int:
        return self.d_kv if self.d_kv is not None else self.d_model // self.n_heads

    @property
    def encoder_layers(self) -> int:
        return self.n_encoder_layers if self.n_encoder_layers is not None else self.n_layers

    @property
    def is_encoder_decoder(self) -> bool:
        return self.arch == "encoder_decoder"

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.d_kv is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                "choose n_heads dividing d_model, or set model.d_kv (the per-head width) "
                "explicitly as T5 does"
            )
        if self.n_encoder_layers is not None and not self.is_encoder_decoder:
            raise ConfigError(
                f"model.n_encoder_layers={self.n_encoder_layers} is only meaningful for "
                f"arch 'encoder_decoder' (got arch {self.arch!r}); remove it"
            )
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"model.position='rope' needs an even head width; got head_dim={self.head_dim}"
            )
        self._check_attention_impl()
        depths = {"decoder": self.n_layers}
        if self.is_encoder_decoder:
            depths["encoder"] = self.encoder_layers
        self.moe.check(depths, self.is_encoder_decoder, self.d_ff)
        check_param_sizes(self)
        return self

    def _check_attention_impl(self) -> None:
        """Combinations a fused attention backend can never run (platform, dtype and length
        checks are at trace time, in models/attention.py)."""
        impl = self.attention_impl
        why = None
        if impl in ("cudnn", "splash") and self.dropout > 0:
            why = f"model.dropout={self.dropout} (attention dropout runs only on 'xla')"
        elif impl == "splash" and self.position == "relative_bias":
            why = "model.position='relative_bias' (splash takes no additive bias; use rope or none)"
        elif impl == "splash" and self.arch == "noncausal_decoder":
            why = "arch 'noncausal_decoder' (splash cannot express the per-row prefix-LM mask)"
        elif impl == "splash" and self.attention == "mixed":
            why = "model.attention='mixed' (splash has no per-head directions)"
        elif impl == "splash" and self.attention == "mixed_layers" and self.is_encoder_decoder:
            why = "model.attention='mixed_layers' (splash has no backward mask for the encoder)"
        if why:
            raise ConfigError(
                f"model.attention_impl={impl!r} cannot run with {why}; use attention_impl "
                "'auto' (it falls back to the reference where a kernel cannot) or 'xla'"
            )


class ObjectiveConfig(Frozen):
    """Pretraining objective and task feature lengths.

    Decoder-only models see sequences of `inputs_length + targets_length` positions; the
    encoder-decoder's encoder sees `inputs_length` and its decoder `targets_length`, except
    for plm with the uniform split (both see the sum; `objectives.feature_lengths`).
    """

    name: ObjectiveName = "flm"
    inputs_length: int = Field(48, ge=1)
    targets_length: int = Field(16, ge=1)
    noise_density: float = Field(0.15, gt=0.0, lt=1.0)  # mlm, bmlm (positions selected)
    mean_noise_span_length: float = Field(3.0, ge=1.0)  # mlm
    # plm: "uniform" splits a piece of L = inputs_length + targets_length tokens at 1..L-1, as
    # Wang et al. / T5 (the encoder-decoder then gets L encoder and L decoder positions);
    # "fit" draws only splits that fit (inputs_length, targets_length) untruncated.
    plm_split: Literal["uniform", "fit"] = "uniform"
    # Pieces cut from 128 documents concatenated (T5's reduce_concat_tokens + split_tokens),
    # or from each document on its own.
    pieces: Literal["concatenated", "per_document"] = "concatenated"
    pack: bool = True

    @property
    def decoder_length(self) -> int:
        return self.inputs_length + self.targets_length


class OptimConfig(Frozen):
    """Optimizer and learning-rate schedule (train/optim.py)."""

    name: Literal["adamw", "adafactor"] = "adamw"
    learning_rate: float = Field(1e-3, gt=0.0)  # peak
    schedule: Literal["constant", "linear", "rsqrt", "cosine", "wsd"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    final_lr_fraction: float = Field(0.1, ge=0.0, le=1.0)  # end of linear/cosine/wsd decay
    cooldown_fraction: float = Field(0.2, gt=0.0, le=1.0)  # wsd: share of steps in cooldown
    cooldown_shape: Literal["linear", "sqrt", "cosine"] = "sqrt"
    cooldown_steps: int | None = Field(None, ge=1)  # wsd: overrides cooldown_fraction
    # The number of updates the schedule is laid over (default train.steps). An adaptation
    # that continues its parent's schedule sets the parent's: a decayed rate stays decayed.
    schedule_steps: int | None = Field(None, ge=1, exclude_if=lambda v: v is None)
    weight_decay: float = Field(0.0, ge=0.0)
    b1: float = Field(0.9, ge=0.0, lt=1.0)
    b2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    grad_clip_norm: float | None = Field(1.0, gt=0.0)
    # adafactor (Shazeer & Stern 2018, as configured in T5X / Wang et al. 2022)
    decay_rate: float = Field(0.8, gt=0.0, le=1.0)
    factored: bool = True
    multiply_by_parameter_scale: bool = True
    clipping_threshold: float | None = Field(1.0, gt=0.0)


class TrainConfig(Frozen):
    """Run length, batch, logging and checkpoint cadence (train/loop.py)."""

    steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1)  # global, in sequences
    microbatches: int = Field(1, ge=1)  # gradient accumulation inside the step
    # Optimizer steps per compiled call (a scan over stacked batches; same losses): pays off
    # when a step is so small that dispatch and per-call overheads show (train/step.py).
    steps_per_call: int = Field(1, ge=1)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    z_loss: float = Field(1e-4, ge=0.0)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0)  # 0: evaluate only at the end
    eval_batches: int = Field(4, ge=1)
    checkpoint_every: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)
    keep_every: int | None = Field(None, ge=1)
    async_checkpoint: bool = True
    # End early (staged training) with a checkpoint.
    stop_after_steps: int | None = Field(None, ge=1)
    progress: bool = True
    # Start from another run's checkpoint (e.g. a WSD cooldown branch from a stable-phase
    # run): a run directory or its checkpoints/ directory, and the step (default: latest).
    # Ignored once this run has checkpoints of its own (it then resumes from them).
    init_from: str | None = None
    init_step: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"train.microbatches={self.microbatches} must divide "
                f"train.batch_size={self.batch_size}"
            )
        if self.init_step is not None and self.init_from is None:
            raise ConfigError(
                f"train.init_step={self.init_step} needs train.init_from (a run directory)"
            )
        return self


class ExperimentConfig(Frozen):
    """Everything one training run needs; `config.yaml` in a run directory is one of these."""

    name: str = "run"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        check_cell(self.model.arch, self.objective.name)
        self.model.moe.check_expert_axis(self.mesh.expert)
        if self.objective.name in ("mlm", "bmlm") and self.data.extra_ids < 1:
            raise ConfigError(
                f"objective.name={self.objective.name!r} needs sentinel ids: data.extra_ids "
                "must be >= 1 "
                f"(got {self.data.extra_ids}); T5 uses 100"
            )
        cooldown = self.optim.cooldown_steps
        if self.optim.schedule == "wsd" and cooldown is not None and cooldown > self.train.steps:
            raise ConfigError(
                f"optim.cooldown_steps={cooldown} is longer than the run "
                f"(train.steps={self.train.steps}); give at most {self.train.steps}, or use "
                "optim.cooldown_fraction"
            )
        return self

    def hash(self) -> str:
        """Stable 12-hex-digit id of the resolved config (the run id in studies)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> ExperimentConfig:
    """Load an ExperimentConfig from YAML (or defaults when `path` is None) plus overrides."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides, ExperimentConfig)
    return validate(ExperimentConfig, data, str(path or "defaults"))


def to_yaml(cfg: BaseModel) -> str:
    """The resolved config as YAML (what a run directory's `config.yaml` holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
