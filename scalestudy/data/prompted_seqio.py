"""Prompted tasks (`prompted.py`) registered as seqio Tasks and their training Mixture.

One Task per training task, named `prompted.<task>`, whose examples are the rendered
{'inputs': prompt, 'targets': delimiter + target} strings tokenized with the run's vocabulary
(no EOS: rank classification scores none) and fitted to the run's lengths; the Mixture
`prompted.<mixture>` samples them in proportion to their examples, capped at `rate_cap`.
"""

from __future__ import annotations

import functools

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data import pipeline, prompted
from scalestudy.data.prompted import PromptedMixture, mixture_name, task_name


def fit_lengths(inputs_max: int, targets_max: int, shared_row: bool):
    """A preprocessor keeping at most `targets_max` target tokens (the first) and the last
    input tokens that fit: `inputs_max` of them, less the targets when both share a row."""
    import tensorflow as tf

    def fit(ds):
        def one(ex):
            targets = ex["targets"][:targets_max]
            room = inputs_max - tf.size(targets) if shared_row else inputs_max
            room = tf.maximum(room, 1)
            return {**ex, "inputs": ex["inputs"][-room:], "targets": targets}

        return ds.map(one, num_parallel_calls=tf.data.AUTOTUNE)

    return fit


def register_mixture(mixture: PromptedMixture, cfg: ExperimentConfig) -> str:
    """Register one seqio Task per training task and their Mixture (examples-proportional
    rates capped at `rate_cap`); returns the Mixture's name, for `data.seqio_task`.

    Lengths come from `cfg` through `pipeline.prompted_lengths`. The held-out check runs
    first, so a held-out task is never registered.
    """
    import seqio
    import tensorflow as tf

    from scalestudy.data.seqio_tasks import output_features

    prompted.check_mixture(mixture)
    features = output_features(cfg.data)
    fit = fit_lengths(*pipeline.prompted_lengths(cfg))
    rates = {}
    for task in mixture.train_tasks:

        def dataset_fn(split, shuffle_files, seed=None, _task=task.name):
            pairs = prompted.examples(mixture, _task, split)
            return tf.data.Dataset.from_tensor_slices(
                {"inputs": [p for p, _ in pairs], "targets": [t for _, t in pairs]}
            )

        name = task_name(task.name)
        seqio.TaskRegistry.remove(name)
        seqio.TaskRegistry.add(
            name,
            source=seqio.FunctionDataSource(dataset_fn, splits=prompted.SPLITS),
            output_features=features,
            preprocessors=[
                functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
                fit,
            ],
        )
        rates[name] = float(
            min(len(prompted.examples(mixture, task.name, "train")), mixture.rate_cap)
        )
    name = mixture_name(mixture)
    seqio.MixtureRegistry.remove(name)
    seqio.MixtureRegistry.add(name, list(rates.items()))
    return name
