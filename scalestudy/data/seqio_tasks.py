"""seqio Tasks and Mixtures for our sources and objectives, for users of the seqio ecosystem.

`register_tasks(cfg)` registers one Task per (source, objective), named
`scalestudy.<source>.<objective>` (source: synthetic, text, tfds; objective: flm, plm, mlm), with
output features `inputs`/`targets` in our vocabulary. Each Task's preprocessors are:

1. rekey the text to `targets` and tokenize it (seqio's tokenize, no EOS);
2. chunk: for flm/plm append EOS to the document, join 128 consecutive documents (T5's
   reduce_concat_tokens; `objective.pieces`), then cut into pieces of the objective's
   piece length, dropping pieces shorter than its minimum (as `numpy_pipeline.py` does);
3. a cache placeholder (everything after it is redone each epoch, with fresh randomness);
4. the objective: `Objective.example` from objectives.py, the very function the NumPy path
   calls, run through `tf.numpy_function` with the example index derived from the per-example
   seed seqio draws for `map_over_dataset(num_seeds=1)`, so that the output is a pure function
   of (get_dataset seed, position in the stream);
5. keep the last `sequence_length['inputs']` input tokens (the NumPy path's left truncation).

Training from any registered Task or Mixture (ours or a user's) is `seqio_pipeline.py`.
"""

from __future__ import annotations

import difflib
import functools
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import seqio
import tensorflow as tf

from scalestudy.config.experiment import OBJECTIVES, DataConfig, ExperimentConfig
from scalestudy.data import DataError, sources, vocab
from scalestudy.data.objectives import EOS_ID, Objective

PREFIX = "scalestudy"
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def task_name(source: str, objective: str) -> str:
    """The registered name of our Task for (source, objective), e.g. 'scalestudy.text.mlm'."""
    return f"{PREFIX}.{source}.{objective}"


def check_objective(name: str) -> None:
    """Refuse an objective the seqio path does not build (bmlm: its in-place rows need the
    NumPy pipeline's converter)."""
    if name == "bmlm":
        raise DataError(
            "objective.name='bmlm' (BERT-style masked LM) is built by the NumPy pipeline only; "
            "use data.source synthetic, text or tfds, not seqio"
        )


# ----------------------------------------------------------------------------- preprocessors


def example_index(seed: Sequence[int] | np.ndarray) -> int:
    """The example index (for `Objective.example`) of a seqio per-example seed pair."""
    s = np.asarray(seed, dtype=np.int64).reshape(-1)
    return (int(s[0]) * _GOLDEN + int(s[1])) & _M64


class _Counter:
    """Examples the objective preprocessor has produced in this process (thread-safe)."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._n += 1

    @property
    def value(self) -> int:
        return self._n


# Resuming must not preprocess the consumed stream again; this count shows it does not.
PREPROCESSED = _Counter()


def apply_objective(
    features: Mapping[str, tf.Tensor], seed: tf.Tensor, *, objective: Objective
) -> dict[str, tf.Tensor]:
    """{'inputs', 'targets'} = objective.example(features['targets'], example_index(seed))."""

    def run(piece: np.ndarray, pair: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        inputs, targets = objective.example(piece.astype(np.int32), example_index(pair))
        PREPROCESSED.add()
        return inputs.astype(np.int32), targets.astype(np.int32)

    pair = tf.reshape(
        tf.cast(tf.stack(seed) if isinstance(seed, tuple | list) else seed, tf.int64), [-1]
    )
    inputs, targets = tf.numpy_function(
        run, [features["targets"], pair], (tf.int32, tf.int32), stateful=False
    )
    inputs.set_shape([None])
    targets.set_shape([None])
    return {"inputs": inputs, "targets": targets}


def objective_preprocessor(objective: Objective):
    """The objective as a seqio preprocessor (seeded per example by seqio's map seeds)."""
    fn = functools.partial(apply_objective, objective=objective)
    functools.update_wrapper(fn, apply_objective)
    return seqio.map_over_dataset(fn, num_seeds=1)


def chunk_preprocessor(piece_length: int, min_piece: int, append_eos: bool, group: int = 1):
    """Documents (tokenized `targets`) -> pieces, exactly as numpy_pipeline.py cuts them: every
    `group` consecutive documents joined (T5's reduce_concat_tokens), then cut."""

    def chunk(ds: tf.data.Dataset) -> tf.data.Dataset:
        def tokens(ex: Mapping[str, tf.Tensor]) -> tf.Tensor:
            ids = tf.cast(ex["targets"], tf.int32)
            if append_eos:
                ids = tf.concat([ids, [EOS_ID]], axis=0)
            return ids

        def pieces(ids: tf.Tensor) -> tf.data.Dataset:
            starts = tf.range(0, tf.size(ids), piece_length)
            rows = tf.RaggedTensor.from_row_starts(ids, starts)
            return tf.data.Dataset.from_tensor_slices({"targets": rows})

        docs = ds.map(tokens)
        if group > 1:
            docs = docs.ragged_batch(group).map(lambda rt: rt.flat_values)
        out = docs.flat_map(pieces)
        return out.filter(lambda ex: tf.size(ex["targets"]) >= min_piece)

    return chunk


def mirror_prefix_lm_pairs(ds: tf.data.Dataset, length: int) -> tf.data.Dataset:
    """Consecutive (inputs, targets) examples in pairs whose splits mirror, s and `length` - s
    (the second piece re-split, within its own length): T5's `pack_prefix_lm_encoder_decoder`
    pairing, so that a packed encoder-decoder row of `length` + `length` holds both. Applied
    after the Task's shuffle, which would separate pairs made inside the Task."""

    def mirror(ex: Mapping[str, tf.RaggedTensor]) -> tf.data.Dataset:
        inputs, targets = ex["inputs"], ex["targets"]
        s = tf.cast(inputs.row_lengths()[0], tf.int32)
        piece = tf.concat([inputs[1], targets[1]], axis=0)
        t = tf.clip_by_value(length - s, 1, tf.maximum(tf.size(piece) - 1, 1))
        return tf.data.Dataset.from_tensor_slices(
            {
                "inputs": tf.ragged.stack([inputs[0], piece[:t]]),
                "targets": tf.ragged.stack([targets[0], piece[t:]]),
            }
        )

    pairs = ds.map(lambda ex: {"inputs": ex["inputs"], "targets": ex["targets"]})
    return pairs.ragged_batch(2, drop_remainder=True).flat_map(mirror)


def trim_inputs_left(
    ds: tf.data.Dataset, sequence_length: Mapping[str, int] | None = None
) -> tf.data.Dataset:
    """Keep the last sequence_length['inputs'] input tokens (the prefix nearest the targets)."""
    if not sequence_length or sequence_length.get("inputs") is None:
        return ds
    n = int(sequence_length["inputs"])

    def trim(ex: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return {**ex, "inputs": ex["inputs"][-n:]}

    return ds.map(trim, num_parallel_calls=tf.data.AUTOTUNE)


# ----------------------------------------------------------------------------- registration


def output_features(data_cfg: DataConfig) -> dict[str, seqio.Feature]:
    """inputs/targets in our vocabulary; EOS is placed by the preprocessors, not by seqio."""
    vocabulary = vocab.seqio_vocabulary(data_cfg)
    return {
        "inputs": seqio.Feature(vocabulary, add_eos=False, required=False),
        "targets": seqio.Feature(vocabulary, add_eos=False),
    }


def _documents_source(data_cfg: DataConfig) -> seqio.FunctionDataSource:
    """Synthetic or local text documents (sources.documents) as a seqio source of {'text'}."""

    @functools.lru_cache(maxsize=2)
    def docs(split: str) -> tuple[str, ...]:
        return tuple(sources.documents(data_cfg, split))

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        texts = tf.constant(docs(split))
        n = int(texts.shape[0])
        if not shuffle_files:
            return tf.data.Dataset.range(n).map(lambda i: {"text": tf.gather(texts, i)})
        # Endless, a fresh seeded permutation each epoch, drawn stateless per position: no
        # shuffle buffer, so a saved iterator state holds a position here, not the corpus.
        key = np.random.SeedSequence().generate_state(1)[0] if seed is None else seed
        key = tf.constant(int(key) & 0x7FFFFFFF, tf.int64)

        def doc(i: tf.Tensor) -> dict[str, tf.Tensor]:
            j = tf.random.experimental.index_shuffle(i % n, tf.stack([key, i // n]), n - 1)
            return {"text": tf.gather(texts, j)}

        return tf.data.Dataset.counter().map(doc)

    return seqio.FunctionDataSource(dataset_fn, splits=sources.SPLITS)


def _tfds_source(data_cfg: DataConfig) -> seqio.TfdsDataSource:
    splits = {"train": data_cfg.train_split, "validation": data_cfg.validation_split}
    return seqio.TfdsDataSource(
        tfds_name=str(data_cfg.tfds_name),
        tfds_data_dir=sources.tfds_data_dir(data_cfg),
        splits=splits,
        read_only=True,  # never build (download) from here
    )


def _add_task(
    name: str,
    source: seqio.DataSource,
    cfg: ExperimentConfig,
    data_cfg: DataConfig,
    objective_name: str,
    text_key: str = "text",
) -> str:
    check_objective(objective_name)
    features = output_features(data_cfg)
    obj_cfg = cfg.objective.replace(name=objective_name)
    objective = Objective(
        obj_cfg,
        vocab_size=features["targets"].vocabulary.vocab_size,
        extra_ids=data_cfg.extra_ids,
        seed=data_cfg.seed,
    )
    preprocessors = [
        functools.partial(seqio.preprocessors.rekey, key_map={"targets": text_key}),
        functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
        chunk_preprocessor(
            objective.piece_length, objective.min_piece, objective.append_eos, objective.group
        ),
        seqio.CacheDatasetPlaceholder(),
        objective_preprocessor(objective),
        trim_inputs_left,
    ]
    seqio.TaskRegistry.remove(name)  # re-registration reflects the current config
    seqio.TaskRegistry.add(
        name, source=source, output_features=features, preprocessors=preprocessors
    )
    return name


def register_tasks(cfg: ExperimentConfig, objectives: Sequence[str] = OBJECTIVES) -> list[str]:
    """Register `scalestudy.<source>.<objective>` Tasks for the sources `cfg.data` describes.

    synthetic: always; text: when `data.paths` is set; tfds: when `data.tfds_name` is set.
    Objective lengths and parameters come from `cfg.objective`; returns the names registered.
    """
    data_cfg = cfg.data
    names = []
    for obj in objectives:
        synthetic = data_cfg.replace(source="synthetic")
        names.append(
            _add_task(
                task_name("synthetic", obj), _documents_source(synthetic), cfg, synthetic, obj
            )
        )
        if data_cfg.paths:
            text = data_cfg.replace(source="text")
            names.append(_add_task(task_name("text", obj), _documents_source(text), cfg, text, obj))
        if data_cfg.tfds_name:
            names.append(
                _add_task(
                    task_name("tfds", obj),
                    _tfds_source(data_cfg),
                    cfg,
                    data_cfg,
                    obj,
                    text_key=data_cfg.text_key,
                )
            )
    return names


def register_text_task(
    cfg: ExperimentConfig,
    name: str,
    paths: Sequence[str | Path],
    *,
    objective: str | None = None,
    validation_paths: Sequence[str | Path] = (),
) -> str:
    """Register a Task over local text files (read as `data.source='text'` reads them)."""
    data_cfg = cfg.data.replace(
        source="text",
        paths=[str(p) for p in paths],
        validation_paths=[str(p) for p in validation_paths],
    )
    obj = objective or cfg.objective.name
    return _add_task(name, _documents_source(data_cfg), cfg, data_cfg, obj)


def register_mixture(name: str, rates: Mapping[str, float]) -> str:
    """Register a seqio Mixture of registered Tasks/Mixtures with sampling rates."""
    if not rates:
        raise DataError(f"mixture {name!r}: give at least one task with a rate")
    for task, rate in rates.items():
        check_registered(task)
        if not rate > 0:
            raise DataError(f"mixture {name!r}: rate of {task!r} must be > 0, got {rate}")
    seqio.MixtureRegistry.remove(name)
    seqio.MixtureRegistry.add(name, [(task, float(rate)) for task, rate in rates.items()])
    return name


def registered_names() -> list[str]:
    """Names of every registered seqio Task and Mixture."""
    return sorted({*seqio.TaskRegistry.names(), *seqio.MixtureRegistry.names()})


def check_registered(name: str) -> None:
    """Raise DataError naming close registered names unless `name` is a Task or Mixture."""
    names = registered_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    ours = [n for n in names if n.startswith(PREFIX + ".")]
    hint = f"close matches: {', '.join(close)}" if close else "no close match"
    raise DataError(
        f"data.seqio_task={name!r} is not a registered seqio Task or Mixture ({hint}). "
        f"Built-in tasks: {', '.join(ours) or 'none'}; register your own in a module and set "
        "data.seqio_module to import it"
    )
