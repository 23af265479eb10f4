"""The `data` section of a run's config: where text comes from (`source` and its keys) and how
it becomes token ids (`vocab`), with the built-in synthetic corpus's own settings. Checked when
the config is read; `data/sources.py` and `data/vocab.py` act on it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from scalestudy.config.base import Frozen, Tuple
from scalestudy.config.errors import ConfigError
from scalestudy.config.yamlio import shown

MAX_SEED = 2**31 - 1  # what a PRNG key and NumPy's generators take on every platform


class SyntheticConfig(Frozen):
    """The built-in synthetic corpus (data/synthetic.py)."""

    n_train_documents: int = Field(20000, ge=1)
    n_validation_documents: int = Field(500, ge=1)
    seed: int = Field(1234, ge=0, le=MAX_SEED)
    # share of in-context episodes (data/synthetic.py); 0: corpus and run ids unchanged
    incontext_share: float = Field(0.0, ge=0.0, le=1.0, exclude_if=lambda v: v == 0.0)


class DataConfig(Frozen):
    """Where text comes from and how it becomes token ids."""

    # order: the order-sensitive corpus of position-encoding experiments (data/order_task.py)
    source: Literal["synthetic", "order", "text", "tfds", "seqio", "grain"] = "synthetic"
    # text: files or directories; documents are whole files, lines, or delimited chunks.
    paths: Tuple = ()
    validation_paths: Tuple = ()  # if empty, hold out `validation_fraction` of documents
    validation_fraction: float = Field(0.02, gt=0.0, lt=1.0)
    split_by: Literal["file", "line", "delimiter"] = "delimiter"
    delimiter: str = "<|endoftext|>"
    # grain: Parquet, Hugging Face datasets or ArrayRecord at `paths` (data/grain_source.py);
    # "auto" tells each path's format by its extension (a directory: by its files). Left out
    # of dumps at its default, so configs, hashes and data fingerprints of other sources keep.
    grain_format: Literal["auto", "parquet", "huggingface", "array_record"] = Field(
        "auto", exclude_if=lambda v: v == "auto"
    )
    # tfds
    tfds_name: str | None = None
    tfds_data_dir: str | None = None
    text_key: str = "text"
    train_split: str = "train"
    validation_split: str = "validation"
    # vocabulary
    vocab: Literal["byte", "sentencepiece"] = "byte"
    spm_path: str | None = None
    extra_ids: int = Field(100, ge=0)
    synthetic: SyntheticConfig = SyntheticConfig()
    # seqio: train from a registered seqio Task or Mixture (data/seqio_pipeline.py); built-in
    # tasks are named scalestudy.<synthetic|text|tfds>.<flm|plm|mlm>; `seqio_module` is imported
    # first so that its registrations run (the current directory is importable). The name may
    # contain "{objective}" (e.g. scalestudy.tfds.{objective}) so a study's cells each get theirs.
    seqio_task: str | None = None
    seqio_module: str | None = None
    max_documents: int | None = Field(None, ge=1)  # per split; caps large (TFDS) corpora
    seed: int = Field(0, ge=0, le=MAX_SEED)  # data order, objective randomness

    @field_validator("paths", "validation_paths")
    @classmethod
    def _path_list(cls, value: tuple, info: ValidationInfo) -> tuple:
        for i, path in enumerate(value):
            if not isinstance(path, str) or not path.strip():
                raise ConfigError(
                    f"data.{info.field_name}[{i}] is {shown(path)}; each entry is a text file or a "
                    f"directory, as a non-empty string (e.g. data.{info.field_name}="
                    "[corpus/train.txt])"
                )
        return value

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source == "text" and not self.paths:
            raise ConfigError(
                "data.paths is empty but data.source='text'; give one or more text files or "
                "directories, e.g. data.paths=[corpus/train.txt]"
            )
        if self.paths and self.source in ("synthetic", "order"):
            raise ConfigError(
                f"data.paths is given but data.source={self.source!r} reads a built-in corpus, "
                "not files; set data.source=text (text, .jsonl) or data.source=grain (Parquet, "
                "Hugging Face datasets, ArrayRecord)"
            )
        if self.source == "grain" and not self.paths:
            raise ConfigError(
                "data.paths is empty but data.source='grain'; give Parquet, ArrayRecord or "
                "Hugging Face dataset files or directories, e.g. data.paths=[corpus.parquet]"
            )
        if self.source == "tfds" and not self.tfds_name:
            raise ConfigError(
                "data.tfds_name is required when data.source='tfds' (e.g. 'c4/en:3.*', 'lm1b')"
            )
        if self.source == "seqio" and not self.seqio_task:
            raise ConfigError(
                "data.seqio_task is required when data.source='seqio': the name of a registered "
                "seqio Task or Mixture, e.g. scalestudy.synthetic.mlm (see README, data)"
            )
        if self.vocab == "sentencepiece" and not self.spm_path:
            raise ConfigError(
                "data.spm_path is required when data.vocab='sentencepiece'; train one with "
                "`scalestudy vocab train` or point at an existing .model file"
            )
        return self
