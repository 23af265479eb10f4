"""Batches from any registered seqio Task or Mixture (`data.source: seqio`), resumable.

`SeqioBatchIterator` is a `batches.BatchIterator`, like the NumPy one: the same features, the
same `state()`/`restore()` interface. The dataset is
`get_mixture_or_task(data.seqio_task).get_dataset(...)` with a fixed seed (`data.seed`),
repeated forever, sharded by process (`seqio.ShardInfo`), converted by the architecture's
seqio feature converter and batched to this process's rows:

- causal decoder, flm: LMFeatureConverter (loss on every token);
- causal decoder, plm/mlm: PrefixLMFeatureConverter ([inputs; targets], loss on the targets
  only) with `decoder_causal_attention` zeroed: the causal decoder has no bidirectional prefix;
- non-causal decoder: PrefixLMFeatureConverter (the prefix, plus the position holding the last
  input token, is marked in `decoder_causal_attention`);
- encoder-decoder: EncDecFeatureConverter, of `objectives.feature_lengths` positions; for
  uniform PLM, consecutive examples are first paired with mirrored splits
  (`seqio_tasks.mirror_prefix_lm_pairs`), so that a row of L + L holds two, as in T5.

Decoder-only rows hold L = inputs_length + targets_length positions for any split of an
example between inputs and targets (as in the NumPy path), so only the total is checked.

Resume without replay: the state of this process's tf.data iterator (shuffle buffers, packing
buffers, source positions, random-seed streams) is serialised with tf.data's own iterator
checkpointing (what `tf.train.Checkpoint(iterator=...)` saves) and kept, base64, in `state()`;
`restore` rebuilds the dataset and loads that state, so no consumed example is read, tokenized
or preprocessed again: resume costs the same at step 10 and at step 10,000. Each process has
its own iterator over its own shard, so each process saves and restores its own state (the
checkpoint keeps one file per process); a state only restores into the same process index,
process count and config.
"""

from __future__ import annotations

import atexit
import base64
import gc
import importlib
import os
import sys
import weakref

import numpy as np
import seqio
import tensorflow as tf

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data import DataError, sources
from scalestudy.data.batches import Batch, check_iterator_args, stream_fingerprint
from scalestudy.data.objectives import feature_lengths
from scalestudy.data.seqio_tasks import (
    PREFIX,
    check_objective,
    check_registered,
    mirror_prefix_lm_pairs,
    register_tasks,
)

_STATE_VERSION = 2  # 1 (earlier release): batches consumed, restored by skipping
# tf.data keeps producing in background threads that call back into Python (the objective);
# such threads still running at interpreter exit deadlock it, so live iterators are closed first.
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for it in list(_LIVE):
        it.close()
    gc.collect()


def import_user_module(name: str) -> None:
    """Import `data.seqio_module` (from the current directory too) so its registrations run."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise DataError(
            f"data.seqio_module={name!r} cannot be imported ({e}); give an importable module "
            "name (a .py file in the current directory without '.py', or an installed package "
            "module) whose import registers your seqio Tasks/Mixtures"
        ) from None


def _check_tfds_prepared(provider: seqio.DatasetProviderBase, data_cfg) -> None:
    """TFDS sources must be prepared locally: a clear error instead of a download attempt."""
    tasks = provider.tasks if isinstance(provider, seqio.Mixture) else [provider]
    for task in tasks:
        source = task.source
        if not isinstance(source, seqio.TfdsDataSource) or source.tfds_dataset.name is None:
            continue
        name = source.tfds_dataset.name
        data_dir = source.tfds_dataset.data_dir or sources.tfds_data_dir(data_cfg)
        if "://" not in data_dir and sources.find_prepared(name, data_dir) is None:
            base = name.partition(":")[0]
            raise DataError(
                f"seqio task {task.name!r}: TFDS dataset {name!r} is not prepared under "
                f"{data_dir!r}. Prepare it once on a machine with network access: `tfds build "
                f"{base} --data_dir {data_dir}` and set data.tfds_data_dir; or use a "
                "scalestudy.synthetic.* or scalestudy.text.* task"
            )


def get_provider(cfg: ExperimentConfig) -> seqio.DatasetProviderBase:
    """The configured Task or Mixture: our tasks registered, the user module imported."""
    register_tasks(cfg)
    if cfg.data.seqio_module:
        import_user_module(cfg.data.seqio_module)
    # "{objective}" lets one study spec name the task of each cell's objective.
    name = str(cfg.data.seqio_task).replace("{objective}", cfg.objective.name)
    check_registered(name)
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == PREFIX and parts[2] != cfg.objective.name:
        raise DataError(
            f"data.seqio_task={name!r} applies objective {parts[2]!r} but objective.name="
            f"{cfg.objective.name!r}; use {'.'.join([*parts[:2], cfg.objective.name])!r}"
        )
    provider = seqio.get_mixture_or_task(name)
    _check_tfds_prepared(provider, cfg.data)
    return provider


def _converter(cfg: ExperimentConfig) -> tuple[seqio.FeatureConverter, dict, dict]:
    """(feature converter, get_dataset sequence_length, converter task lengths)."""
    obj, arch, pack = cfg.objective, cfg.model.arch, cfg.objective.pack
    n_in, n_tgt, L = obj.inputs_length, obj.targets_length, obj.decoder_length
    if arch == "encoder_decoder":
        enc, dec = feature_lengths(obj, encoder_decoder=True)
        lengths = {"inputs": enc, "targets": dec}
        return seqio.EncDecFeatureConverter(pack=pack), lengths, lengths
    if obj.name == "flm":
        return seqio.LMFeatureConverter(pack=pack), {"targets": L}, {"targets": L}
    # Decoder-only: any split of an example's <= L tokens fits the row, so the per-feature
    # length check is off and the concatenation is packed into I + T = L positions.
    converter = seqio.PrefixLMFeatureConverter(pack=pack, apply_length_check=False)
    return converter, {"inputs": L, "targets": L}, {"inputs": n_in, "targets": n_tgt}


class SeqioBatchIterator:
    """This process's rows of each global batch from a seqio Task/Mixture; resumable."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        split: str = "train",
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        check_iterator_args(cfg, split, process_index, process_count)
        check_objective(cfg.objective.name)
        B = cfg.train.batch_size
        self.cfg = cfg
        self.split = split
        self._provider = get_provider(cfg)
        if split not in self._provider.splits:
            raise DataError(
                f"seqio task {self._provider.name!r} has no split {split!r}; it has "
                f"{', '.join(sorted(self._provider.splits))}"
            )
        vocab_size = self._provider.output_features["targets"].vocabulary.vocab_size
        if vocab_size > cfg.model.vocab_size:
            raise DataError(
                f"seqio task {self._provider.name!r} uses a vocabulary of {vocab_size} ids but "
                f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size >= {vocab_size}"
            )
        self._shard = seqio.ShardInfo(index=process_index, num_shards=process_count)
        self._rows = B // process_count
        self._step = 0
        # Corpus tokens in this process's rows of the last batch: real tokens that are neither
        # EOS nor sentinels (seqio keeps no link back to the documents).
        self.last_document_tokens = 0
        # Each process streams its own shard: the layout is part of what a state restores into.
        self._fingerprint = stream_fingerprint(cfg, split, process_index, process_count)
        self._it = self._iterator()
        _LIVE.add(self)

    def _dataset(self) -> tf.data.Dataset:
        converter, sequence_length, task_lengths = _converter(self.cfg)
        ds = self._provider.get_dataset(
            sequence_length=sequence_length,
            split=self.split,
            shuffle=self.split == "train",
            seed=self.cfg.data.seed,
            shard_info=self._shard if self._shard.num_shards > 1 else None,
            num_epochs=None,
            # An in-memory cache would be written into every iterator state.
            try_in_mem_cache=False,
        )
        obj = self.cfg.objective
        if self.cfg.model.is_encoder_decoder and (obj.name, obj.plm_split) == ("plm", "uniform"):
            # Rows of L + L positions: two examples per row, as T5 pairs them.
            ds = mirror_prefix_lm_pairs(ds, obj.decoder_length)
        ds = converter(ds, task_lengths)
        return ds.batch(self._rows, drop_remainder=True).prefetch(2)

    def _iterator(self):
        return iter(self._dataset())

    def close(self) -> None:
        """Stop the background tf.data work (also done for every live iterator at exit)."""
        self._it = None

    # ------------------------------------------------------------------ state

    def state(self) -> dict:
        """JSON-able position of this process's stream: its tf.data iterator state (base64),
        the batches consumed and a fingerprint of the config and process layout."""
        if self._it is None:
            raise DataError("this seqio data iterator was closed; its state is gone")
        # Iterator checkpointing as tf.train.Checkpoint does it, kept in memory: one string.
        tf_state = self._it._save().numpy()
        return {
            "version": _STATE_VERSION,
            "kind": "seqio",
            "split": self.split,
            "step": self._step,
            "process": [self._shard.index, self._shard.num_shards],
            "fingerprint": self._fingerprint,
            "tf_data": base64.b64encode(tf_state).decode("ascii"),
        }

    def restore(self, state: dict) -> None:
        """Continue from `state`, this process's own: loads the tf.data state, replays nothing."""
        if (
            not isinstance(state, dict)
            or state.get("version") not in (1, _STATE_VERSION)  # 1: explained below
            or state.get("kind") != "seqio"
        ):
            raise DataError(
                f"not a seqio data iterator state (version {_STATE_VERSION}): {str(state)[:200]}"
            )
        if state.get("fingerprint") != self._fingerprint:
            raise DataError(
                "seqio data iterator state was saved for a different data/objective/arch/batch "
                f"config or process layout (fingerprint {state.get('fingerprint')} != "
                f"{self._fingerprint}, saved by process {state.get('process', '?')}, this is "
                f"process [{self._shard.index}, {self._shard.num_shards}]); resume with the "
                "run's own config.yaml and process count"
            )
        if state["version"] == 1:
            raise DataError(
                "this seqio data iterator state was saved by an earlier release (it holds only "
                "the number of batches consumed, and that release read documents in another "
                "order), so its stream cannot be continued exactly: start the run again in a "
                "new workdir, or finish it with the release that started it"
            )
        if self._it is None:
            self._it = self._iterator()
        # Replaces the iterator's whole state (buffers included), wherever it stood.
        self._it._restore(tf.constant(base64.b64decode(state["tf_data"])))
        self._step = int(state["step"])

    def skip_to(self, step: int) -> None:
        """Position at `step` by producing and dropping the batches before it: how resuming
        worked before iterator checkpoints (kept to measure against, in
        `bench.data.bench_resume`)."""
        self._it = iter(self._dataset().skip(step))
        self._step = step

    # ------------------------------------------------------------------ batches

    def __iter__(self) -> SeqioBatchIterator:
        return self

    def __next__(self) -> Batch:
        if self._it is None:
            raise DataError("this seqio data iterator was closed")
        raw = next(self._it)
        self._step += 1
        batch = self._contract({k: v.numpy() for k, v in raw.items()})
        self.last_document_tokens = self._document_tokens(batch)
        return batch

    def _document_tokens(self, batch: Batch) -> int:
        vocabulary = self._provider.output_features["targets"].vocabulary
        first_sentinel = vocabulary.vocab_size - vocabulary.extra_ids
        keys = ("encoder_input_tokens", "decoder_target_tokens")
        return sum(
            int(
                np.sum(
                    (batch[k] > 0) & (batch[k] != vocabulary.eos_id) & (batch[k] < first_sentinel)
                )
            )
            for k in keys
            if k in batch
        )

    def _contract(self, raw: Batch) -> Batch:
        """seqio's features -> the batch contract (int32; segments/positions when unpacked)."""
        f = {k: np.asarray(v, np.int32) for k, v in raw.items()}
        for prefix, token_key in (
            ("decoder", "decoder_target_tokens"),
            ("encoder", "encoder_input_tokens"),
        ):
            if token_key not in f or f"{prefix}_segment_ids" in f:
                continue
            # Unpacked rows: one segment of the non-padding positions (ids are never 0).
            real = f[token_key] != 0
            f[f"{prefix}_segment_ids"] = real.astype(np.int32)
            f[f"{prefix}_positions"] = np.where(real, np.arange(real.shape[1]), 0).astype(np.int32)
        if self.cfg.model.arch != "noncausal_decoder" or "decoder_causal_attention" not in f:
            f["decoder_causal_attention"] = np.zeros_like(f["decoder_target_tokens"])
        return f
