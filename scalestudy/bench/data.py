"""Data pipeline throughput (NumPy, seqio and Grain paths), the seqio stream's resume cost, and
the Grain path's reading and batch rate against the configured training step."""

from __future__ import annotations

import json
import time
from typing import Any

from scalestudy.bench.cells import cells
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data import require_seqio, sources, vocab
from scalestudy.data.pipeline import make_iterator


def bench(cfg: ExperimentConfig | None, steps: int) -> dict:
    """Batches/s, examples/s and tokens/s of every valid cell (bmlm's too) on the configured
    corpus; for
    `data.source: seqio`, the configured stream's resume cost at step `steps` instead; for
    `data.source: grain`, the Grain path against the training step (`bench_grain`).

    tokens = non-padding positions (decoder + encoder); loss_tokens = loss-bearing positions.
    Without a config: the synthetic corpus, batch 64 and the default lengths.
    """
    if cfg is not None and cfg.data.source == "seqio":
        return bench_resume(cfg, steps)
    if cfg is not None and cfg.data.source == "grain":
        return bench_grain(cfg, steps)
    if cfg is None:
        cfg = ExperimentConfig(train={"batch_size": 64})
    out: dict[str, float | int | str] = {
        "source": cfg.data.source,
        "batch_size": cfg.train.batch_size,
        "lengths": f"{cfg.objective.inputs_length}+{cfg.objective.targets_length}",
    }
    for arch, name, cell in cells(cfg, extra=True):
        it = make_iterator(cell)
        next(it)  # first batch builds the corpus caches; not timed
        examples, rates = 0, _Counts()
        t0 = time.perf_counter()
        for _ in range(steps):
            before = it.state()["cursor"]
            rates.add(next(it))
            examples += it.state()["cursor"] - before
        dt = time.perf_counter() - t0
        key = f"{name}/{arch}"
        out[f"{key}/examples_per_s"] = round(examples / dt)
        out.update(rates.per_s(key, dt))
    return out


def bench_seqio(cfg: ExperimentConfig | None, steps: int) -> dict:
    """`bench` for the seqio path: every valid cell through `scalestudy.<source>.*`.

    Without a config: the synthetic corpus, batch 64 and the default lengths.
    """
    require_seqio("bench data's seqio path")
    from scalestudy.data.seqio_pipeline import SeqioBatchIterator
    from scalestudy.data.seqio_tasks import PREFIX

    if cfg is None:
        cfg = ExperimentConfig(train={"batch_size": 64})
    source = cfg.data.source if cfg.data.source in ("synthetic", "text", "tfds") else "synthetic"
    out: dict[str, float | int | str] = {
        "source": f"seqio:{source}",
        "batch_size": cfg.train.batch_size,
        "lengths": f"{cfg.objective.inputs_length}+{cfg.objective.targets_length}",
    }
    for arch, name, cell in cells(cfg):
        task = f"{PREFIX}.{source}.{name}"
        cell = cell.replace(data={**cell.data.model_dump(), "source": "seqio", "seqio_task": task})
        it = SeqioBatchIterator(cell)
        next(it)  # builds the graph and fills the pipeline; not timed
        rates = _Counts()
        t0 = time.perf_counter()
        for _ in range(steps):
            rates.add(next(it))
        dt = time.perf_counter() - t0
        it.close()
        out.update(rates.per_s(f"{name}/{arch}", dt))
    return out


def bench_resume(cfg: ExperimentConfig, steps: int) -> dict:
    """Resume cost of the configured seqio stream at step `steps`: this process's state size
    and save time, the time to the first batch after `restore` (the dataset built, the state
    loaded) against a fresh start and against skipping the consumed batches (how resuming
    worked before), and the examples each way preprocesses again (`seqio_tasks.PREPROCESSED`).
    """
    require_seqio("bench data with data.source='seqio'")
    from scalestudy.data.seqio_pipeline import SeqioBatchIterator
    from scalestudy.data.seqio_tasks import PREPROCESSED

    def timed(fn):
        n0, t0 = PREPROCESSED.value, time.perf_counter()
        it = fn()
        next(it)
        out = time.perf_counter() - t0, PREPROCESSED.value - n0
        it.close()
        return out

    it = SeqioBatchIterator(cfg)
    next(it)
    tokens, t0 = 0, time.perf_counter()
    for _ in range(steps - 1):
        tokens += int((next(it)["decoder_segment_ids"] > 0).sum())
    run_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state = it.state()
    state_s = time.perf_counter() - t0
    it.close()

    def resumed(skip: bool):
        def make() -> SeqioBatchIterator:
            fresh = SeqioBatchIterator(cfg)
            if skip:
                fresh.skip_to(steps)
            else:
                fresh.restore(state)
            return fresh

        return make

    start_s, start_n = timed(lambda: SeqioBatchIterator(cfg))
    restore_s, restore_n = timed(resumed(skip=False))
    skip_s, skip_n = timed(resumed(skip=True))
    return {
        "source": f"seqio:{cfg.data.seqio_task}",
        "arch": cfg.model.arch,
        "batch_size": cfg.train.batch_size,
        "lengths": f"{cfg.objective.inputs_length}+{cfg.objective.targets_length}",
        "step": steps,
        "tokens_per_s": round(tokens / max(run_s, 1e-9)),
        "state_bytes": len(json.dumps(state)),
        "state_s": round(state_s, 3),
        "fresh_start_s": round(start_s, 2),
        "fresh_start_preprocessed": start_n,
        "restore_s": round(restore_s, 2),
        "restore_preprocessed": restore_n,
        "skip_s": round(skip_s, 2),
        "skip_preprocessed": skip_n,
    }


def bench_grain(cfg: ExperimentConfig, steps: int) -> dict:
    """The configured Grain corpus and cell: reading the documents through Grain's sources
    (documents/s, MB/s), tokenising them, the first batch (both again, inside the iterator),
    then `steps` batches (batches/s) against `steps` training steps of the configured model:
    `data_share` is a batch's time over a step's, the share of a step the host would spend
    making its batch if nothing overlapped them."""
    # Importing grain and pyarrow takes seconds once per process: not the reading measured.
    import grain  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from scalestudy.bench.train import time_train_steps

    t0 = time.perf_counter()
    docs = sources.documents(cfg.data, "train")
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids, _ = vocab.encode_documents(vocab.get_vocabulary(cfg.data), docs)
    encode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    it = make_iterator(cfg)
    next(it)
    first_s = time.perf_counter() - t0
    rates = _Counts()
    t0 = time.perf_counter()
    for _ in range(steps):
        rates.add(next(it))
    batch_s = (time.perf_counter() - t0) / steps
    train = time_train_steps(cfg, steps)
    megabytes = sum(len(d.encode()) for d in docs) / 1e6
    return {
        "source": f"grain:{','.join(map(str, cfg.data.paths))}",
        "cell": f"{cfg.objective.name}/{cfg.model.arch}",
        "batch_size": cfg.train.batch_size,
        "lengths": f"{cfg.objective.inputs_length}+{cfg.objective.targets_length}",
        "documents": len(docs),
        "corpus_tokens": int(ids.size),
        "read_s": round(read_s, 2),
        "read_documents_per_s": round(len(docs) / read_s),
        "read_mb_per_s": round(megabytes / read_s, 1),
        "encode_s": round(encode_s, 2),
        "first_batch_s": round(first_s, 2),
        "batches_per_s": round(1 / batch_s, 1),
        **rates.per_s("batch", batch_s * steps),
        "train_step_ms": train["step_ms"],
        "train_steps_per_s": round(1e3 / train["step_ms"], 1),
        "data_share": round(1e3 * batch_s / train["step_ms"], 4),
    }


class _Counts:
    """Non-padding positions (decoder + encoder) and loss-bearing positions seen."""

    def __init__(self) -> None:
        self.tokens = self.loss_tokens = 0

    def add(self, batch: dict[str, Any]) -> None:
        self.tokens += int((batch["decoder_segment_ids"] > 0).sum())
        if "encoder_segment_ids" in batch:
            self.tokens += int((batch["encoder_segment_ids"] > 0).sum())
        self.loss_tokens += int(batch["decoder_loss_weights"].sum())

    def per_s(self, key: str, seconds: float) -> dict[str, int]:
        return {
            f"{key}/tokens_per_s": round(self.tokens / seconds),
            f"{key}/loss_tokens_per_s": round(self.loss_tokens / seconds),
        }
