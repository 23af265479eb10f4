"""A run directory as an lm-evaluation-harness model, registered as "scalestudy".

`ScalestudyLM(workdir=RUN)` loads a run's config and checkpoint as `scalestudy eval` does
(`rank.load_run`: the run's own mesh and shardings) and answers the harness's three requests
through the package's own paths, for every architecture:

- `loglikelihood`: (context, continuation) pairs tokenised as lm-eval tokenises them
  (`data.pipeline.encode_scoring_pair`, as `scalestudy eval` does) and scored by `Scorer`
  after `budget.fit_pairs`, each context cut from the left, as lm-eval cuts it, to what fits
  in `max_length` positions: the causal decoder reads context and continuation causally, the
  non-causal decoder holds the context in its bidirectional prefix, the encoder-decoder
  encodes the context and scores the continuation in its decoder.
- `loglikelihood_rolling`: a text's log-likelihood in windows of the training length, each
  token predicted once, every window scored as a (context, continuation) pair by the same
  path. Decoder-only (model arg `rolling`): `lm_eval` (default), lm-eval's own windows
  (`lm_eval_windows`): the first row is the start token (lm-eval's prefix token) and
  `max_length - 1` text tokens, every later row `max_length` text tokens without it;
  `start_token`, every row starting with the start token as training rows do
  (`rolling_windows`). The encoder-decoder has windows of its own (`rolling_windows`): the
  first window's encoder reads a lone EOS, as for any empty context.
- `generate_until`: greedy decoding with the package's key/value cache (`Model.generate`),
  cut at the first stop string, at most `max_gen_toks` tokens, a decoder-only prompt keeping at
  least half of `max_length`; prompts of different lengths
  share a call, padded to the lengths of scoring's ladder (`batching.bucket_length`).

lm-eval 0.4.x finds no models outside its own package (`lm_eval --model scalestudy` says "no
model for this name found"): `scalestudy harness ARGS` imports this module (registering the
model) and hands ARGS to lm-eval's own command line unchanged.

Kept whole: the model lm-eval calls and the command that registers it and answers for its
refusals are one interface to one outside program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import logging.handlers
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from scalestudy.config.errors import ScalestudyError, checked_path
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.objectives import feature_lengths, scoring_inputs_suffix
from scalestudy.data.pipeline import encode_scoring_pair
from scalestudy.data.vocab import get_vocabulary
from scalestudy.evaluate import rank
from scalestudy.evaluate.batching import bucket_length
from scalestudy.evaluate.budget import fit_pairs
from scalestudy.evaluate.scorer import Scorer, scoring_config
from scalestudy.models.api import build_model
from scalestudy.train import sharding

LMEVAL_EXTRA = "pip install 'scalestudy[lmeval]'"

try:
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import simple_parse_args_string
except ImportError:
    raise ScalestudyError(
        "the lm-evaluation-harness model needs lm-eval (0.4.10 or later), which this "
        f"environment does not have; install the extra: {LMEVAL_EXTRA}"
    ) from None

MODEL_ARGS = ("workdir", "step", "batch_size", "max_length", "rolling", "eval.KEY")
ROLLING = ("lm_eval", "start_token")  # decoder-only rolling windows; the first the default
START_TOKEN = 0  # what a decoder row's first position reads (`data.batches.write_decoder`)
DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for generate_until tasks


def rolling_windows(
    tokens: Sequence[int], row: int, encoder: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """(context, predicted) windows that predict every token of `tokens` exactly once, in order.

    Decoder-only (`encoder` None): context and predicted tokens share a row of `row` tokens,
    as the harness's rolling windows do: the first window predicts the first `row` tokens from
    no context, each later one the next `row - 1` after the `row - len(predicted)` tokens before
    them (the last window gets the most context). Encoder-decoder: each window predicts `row`
    tokens in the decoder after up to `encoder` tokens before them in the encoder.
    """
    first, chunk = (row, row - 1) if encoder is None else (row, row)
    windows = [([], list(tokens[:first]))] if len(tokens) else []
    start = first
    while start < len(tokens):
        predicted = list(tokens[start : start + chunk])
        room = row - len(predicted) if encoder is None else encoder
        windows.append((list(tokens[max(0, start - room) : start]), predicted))
        start += len(predicted)
    return windows


def lm_eval_windows(
    tokens: Sequence[int], row: int, prefix_token: int = START_TOKEN
) -> list[tuple[list[int], list[int]]]:
    """lm-eval's rolling windows of `tokens` in rows of `row` tokens, as its causal models make
    them (`get_rolling_token_windows(tokens, prefix_token, row, context_len=1)`, each made
    disjoint by `make_disjoint_window`): (context, predicted) with `context + predicted[:-1]`
    the row. The first window's context is `[prefix_token]` and it predicts the first `row`
    tokens; each later row is `row` text tokens predicting the next up to `row` tokens after
    the `row + 1 - len(predicted)` before them (the last window gets the most context)."""
    tokens = list(tokens)
    if not tokens:
        return []
    windows = [([prefix_token], tokens[:row])]
    start = row
    while start < len(tokens):
        end = min(start + row, len(tokens))
        windows.append((tokens[max(0, end - row - 1) : start], tokens[start:end]))
        start = end
    return windows


def _model_args(kwargs: dict) -> tuple[dict, list[str]]:
    """Known model args and `eval.key=value` overrides; any other key is refused by name."""
    known = {
        k: kwargs.pop(k)
        for k in ("workdir", "step", "batch_size", "max_length", "rolling")
        if k in kwargs
    }
    # The harness passes these from its own command line (--device defaults to cuda:0): JAX
    # places the model on the run's mesh over the devices it sees (JAX_PLATFORMS chooses).
    kwargs.pop("max_batch_size", None)
    kwargs.pop("device", None)
    overrides = [f"{k}={v}" for k, v in kwargs.items() if k.startswith("eval.")]
    unknown = sorted(k for k in kwargs if not k.startswith("eval."))
    if unknown:
        raise ScalestudyError(
            f"model_args: unknown key {unknown[0]!r}; accepted: {', '.join(MODEL_ARGS)} "
            "(e.g. --model_args workdir=runs/tiny,step=100,eval.inputs_length=512)"
        )
    return known, overrides


def _whole(name: str, value, least: int = 1) -> int | None:
    """`value` (an int or its text) as an int of at least `least`; None stays None."""
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("-").isdigit() or int(text) < least:
        raise ScalestudyError(f"model_args: {name}={value!r}; accepted: a whole number >= {least}")
    return int(text)


@register_model("scalestudy")
class ScalestudyLM(LM):
    """A scalestudy run's checkpoint as an lm-eval model (model_args: `MODEL_ARGS`)."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """The model of `--model_args` text; a key given there wins over the same setting
        from lm-eval's own options (its --batch_size is always given, 1 by default)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """The model of `arg_dict` (model args) over `additional_config` (lm-eval's options)."""
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**given, **arg_dict})

    def __init__(self, **model_args) -> None:
        super().__init__()
        _release_logs()
        known, overrides = _model_args(dict(model_args))
        workdir = known.get("workdir")
        self.rolling = str(known.get("rolling", ROLLING[0])).strip()
        if self.rolling not in ROLLING:
            raise ScalestudyError(
                f"model_args: rolling={known['rolling']!r}; accepted: {', '.join(ROLLING)}"
            )
        if not workdir:
            raise ScalestudyError(
                "model_args: workdir is required: the run directory to evaluate "
                "(e.g. --model_args workdir=runs/tiny)"
            )
        step = _whole("step", known.get("step"), least=0)
        batch_size = known.get("batch_size")
        if batch_size is not None and str(batch_size).startswith("auto"):
            batch_size = None  # the run's eval.batch_size
        batch_size = _whole("batch_size", batch_size)
        if batch_size is not None:
            # Before the eval.* keys: an explicit eval.batch_size wins over lm-eval's default.
            overrides.insert(0, f"eval.batch_size={batch_size}")
        with _quiet_absl():  # orbax logs "read only" for each item of a read-only restore
            cfg, params, self.step = rank.load_run(Path(str(workdir)), step, overrides)
        self.workdir = Path(str(workdir))
        self.run_cfg = cfg
        self.model = build_model(cfg.model)
        self.mesh = jax.tree.leaves(params)[0].sharding.mesh
        self.scorer = Scorer(cfg, self.model, params, mesh=self.mesh)
        self.cfg = scoring_config(cfg)
        self.vocab = get_vocabulary(cfg.data)
        self.suffix = list(scoring_inputs_suffix(cfg.objective))
        # Training rows: (encoder, decoder) positions, encoder 0 for the decoder-only models.
        self.encoder_length, self.decoder_length = feature_lengths(
            cfg.objective, cfg.model.is_encoder_decoder
        )
        # Context positions of one row: the encoder's, or the decoder row context shares.
        self.max_length = _whole("max_length", known.get("max_length")) or (
            self.encoder_length or self.decoder_length
        )
        least = len(self.suffix) + (1 if self.encoder_length else 2)
        if self.max_length < least:
            raise ScalestudyError(
                f"model_args: max_length={self.max_length} leaves no room for a rolling window "
                f"(context and prediction); accepted: {least} or more"
            )
        self._generate = jax.jit(self.model.generate, static_argnums=2)
        # loglikelihood's rule, lm-eval's: a context keeps what fits beside its continuation
        # in max_length positions (the encoder's max_length for the encoder-decoder).
        ev = self.cfg.eval
        if self.encoder_length:
            lengths = {"inputs_length": self.max_length, "targets_length": 1}
        else:
            lengths = {"inputs_length": self.max_length - 1, "targets_length": 1}
        rule = ev.replace(context_rule="wang2022", **lengths)
        self.truncating = self.cfg.replace(eval=rule)

    # ------------------------------------------------------------------ scoring

    def _score(
        self,
        cfg: ExperimentConfig,
        inputs: list[list[int]],
        targets: list[list[int]],
        what: str,
        start_token: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        fitted = fit_pairs(cfg, inputs, targets, what)
        lp, _, greedy = self.scorer.score(fitted, start_token=start_token)
        cut = int(fitted.cut.sum())
        if cut:
            warnings.warn(
                f"{what}: {cut} of {len(inputs)} contexts cut from the left to fit "
                f"max_length={self.max_length} beside their continuations",
                stacklevel=3,
            )
        if not start_token:  # the first context token takes the start token's position
            fitted = dataclasses.replace(fitted, inputs=[x[1:] for x in fitted.inputs])
        rank.beyond_training(cfg, what, fitted, np.arange(len(inputs)))
        return np.asarray(lp, np.float64), np.asarray(greedy, bool)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """Per (context, continuation): the continuation's summed log-probability and whether
        greedy decoding would produce it, as `scalestudy eval` scores a choice."""
        if not requests:
            return []
        pairs = [req.args for req in requests]
        encoded = [encode_scoring_pair(self.run_cfg, self.vocab, c, t) for c, t in pairs]
        inputs = [c for c, _ in encoded]
        targets = [t for _, t in encoded]
        # An empty continuation has probability 1 (log 0), and greedy decoding "produces" it.
        out = [(0.0, True)] * len(pairs)
        scored = [i for i, t in enumerate(targets) if t]
        if scored:
            lp, greedy = self._score(
                self.truncating,
                [inputs[i] for i in scored],
                [targets[i] for i in scored],
                "lm-eval loglikelihood",
            )
            for i, a, g in zip(scored, lp, greedy, strict=True):
                out[i] = (float(a), bool(g))
        for pair, result in zip(pairs, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return out

    def windows(self, tokens: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        """The rolling windows of `tokens` for this model (see the module docstring); with
        `rolling=lm_eval` (decoder-only) lm-eval's own, the first context `[START_TOKEN]`."""
        room = self.max_length - len(self.suffix)  # context positions beside the input form
        if self.encoder_length:  # the context in the encoder
            return rolling_windows(tokens, self.decoder_length, room)
        if self.rolling == "lm_eval":  # rows of max_length: start token only in the first
            return lm_eval_windows(tokens, room, START_TOKEN)
        # One decoder row of max_length positions: start token, context, predicted[:-1].
        return rolling_windows(tokens, room)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Per text: the log-likelihood of all its tokens, windows of the training length."""
        lm_eval_rows = self.rolling == "lm_eval" and not self.encoder_length
        # Rows with the start token (lm_eval: each text's first, its context the start token
        # that the scorer puts there itself) and rows without it (lm_eval's later windows).
        groups: dict[bool, tuple[list, list, list]] = {True: ([], [], []), False: ([], [], [])}
        for i, req in enumerate(requests):
            for w, (context, predicted) in enumerate(self.windows(self.vocab.encode(req.args[0]))):
                start = not lm_eval_rows or w == 0
                inputs, targets, owner = groups[start]
                inputs.append(context[1:] if lm_eval_rows and start else context)
                targets.append(predicted)
                owner.append(i)
        totals = np.zeros(len(requests))
        # Windows fit the training rows by construction: no context rule, no cut.
        ev = self.cfg.eval.replace(context_rule="same", inputs_length=None, max_length=1 << 30)
        cfg = self.cfg.replace(eval=ev)
        for start, (inputs, targets, owner) in groups.items():
            if inputs:
                what = "lm-eval loglikelihood_rolling"
                lp, _ = self._score(cfg, inputs, targets, what, start_token=start)
                np.add.at(totals, np.asarray(owner), lp)
        out = [float(t) for t in totals]
        for req, result in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, result)
        return out

    # ------------------------------------------------------------------ generation

    def _prompt_tokens(self, context: str, steps: int) -> tuple[list[int], bool]:
        """The prompt as the model reads it (input form appended), cut from the left to fit
        max_length beside the generated tokens (decoder-only) or the encoder; whether cut."""
        tokens = list(self.vocab.encode(context))
        keep = self.max_length - len(self.suffix)
        if not self.encoder_length:
            # The decoder row holds the generated tokens too, but a task's max_gen_toks is a
            # cap (most stop at a stop string well before it): the prompt keeps at least half
            # the row, and generation runs on past it only if it has to.
            keep -= min(steps, keep // 2)
        kept = tokens[max(len(tokens) - keep, 0) :]
        prompt = kept + self.suffix
        if self.encoder_length and not prompt:
            prompt = [self.vocab.eos_id]  # an empty input is a lone EOS, as in scoring
        return prompt, len(kept) < len(tokens)

    def generate_until(self, requests) -> list[str]:
        """Per (context, gen_kwargs): the greedy continuation, cut before the first of
        gen_kwargs["until"] (a string or a list), at most gen_kwargs["max_gen_toks"] tokens."""
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            if kwargs.get("do_sample"):
                raise ScalestudyError(
                    "generate_until: do_sample=True asked for, but the scalestudy model decodes "
                    "greedily only; set do_sample: false (temperature 0) in the task"
                )
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            steps = _whole("max_gen_toks", kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            prompt, cut = self._prompt_tokens(context, steps)
            jobs.append((prompt, steps, until, cut))
        cut = sum(j[3] for j in jobs)
        if cut:
            warnings.warn(
                f"generate_until: {cut} of {len(jobs)} prompts cut from the left to fit "
                f"max_length={self.max_length}",
                stacklevel=2,
            )
        out: list[str | None] = [None] * len(jobs)
        # Prompts padded to the lengths of scoring's ladder: a handful of compiled shapes.
        longest = max((len(j[0]) for j in jobs), default=0)
        shapes: dict[tuple[int, int], list[int]] = {}
        for i, (prompt, steps, _, _) in enumerate(jobs):
            length = bucket_length(len(prompt), longest) if prompt else 0
            shapes.setdefault((length, steps), []).append(i)
        rows = self.scorer.rows
        for (length, steps), members in shapes.items():
            for s in range(0, len(members), rows):
                part = members[s : s + rows]
                # Fill the call's shape: the batch shards need whole rows; reuse a prompt.
                size = -(-len(part) // self.scorer.shards) * self.scorer.shards
                idx = part + [part[0]] * (size - len(part))
                prompt_BP = np.zeros((size, length), np.int32)
                lengths_B = np.array([len(jobs[i][0]) for i in idx], np.int32)
                for row, i in enumerate(idx):
                    prompt_BP[row, : lengths_B[row]] = jobs[i][0]
                with sharding.axis_rules(self.mesh):
                    tokens_BT = np.asarray(
                        jax.device_get(
                            self._generate(self.scorer.params, prompt_BP, steps, lengths_B)
                        )
                    )
                for row, i in enumerate(part):
                    out[i] = _cut_at_stop(self.vocab.decode(tokens_BT[row].tolist()), jobs[i][2])
        for req, text in zip(requests, out, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return [str(t) for t in out]


@contextlib.contextmanager
def _quiet_absl():
    """absl's log (orbax's) at errors only for the block: its warnings are not the user's."""
    from absl import logging as absl_logging

    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


def _cut_at_stop(text: str, until: Sequence[str]) -> str:
    """`text` up to the earliest occurrence of any stop string."""
    ends = [text.find(s) for s in until if s and s in text]
    return text[: min(ends)] if ends else text


# lm-eval's refusals of its command line (an unknown task, a missing include path): one line.
_REFUSALS = (ValueError, FileNotFoundError, NotADirectoryError, KeyError)
_log_held: list[logging.handlers.MemoryHandler] = []  # lm-eval's log until the model starts


def run_cli(argv: list[str]) -> int:
    """lm-eval's own command line on `argv`, unchanged, with "scalestudy" registered. Its
    log is held until the model starts (and dropped when lm-eval refuses the command first),
    so a refusal is one line."""
    check_shots(argv)
    given = sys.argv
    sys.argv = ["lm-eval", *argv]
    _hold_logs()
    finished = False
    try:
        cli_evaluate()
        finished = True
    except SystemExit as e:  # its argument errors and --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except ConnectionError as e:  # a task's data on a hub this host cannot reach
        text = " ".join(str(e).split()) or type(e).__name__
        raise ScalestudyError(
            f"lm-eval could not fetch a task's data ({text}); give a task whose data is on "
            "this host (--include_path DIR with a local dataset_path) or prepare its cache"
        ) from None
    except _REFUSALS as e:
        if not _log_held:  # raised after the model started: not a refusal of the command
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        raise ScalestudyError(f"lm-eval refused the command: {text}") from None
    finally:
        sys.argv = given
        while _log_held:  # never started a model: its log out if it finished, else dropped
            _log_held.pop().give_out(finished)  # type: ignore[attr-defined]
    return 0


def check_shots(argv: Sequence[str]) -> None:
    """Refuse `--num_fewshot` below 0 (lm-eval would take it and score zero-shot) and an
    `--include_path` that is not a directory (lm-eval would skip it without a word and look
    its tasks up elsewhere)."""
    for i, item in enumerate(argv):
        flag, sep, value = item.partition("=")
        if flag not in ("--num_fewshot", "--include_path"):
            continue
        value = value if sep else (argv[i + 1] if i + 1 < len(argv) else "")
        if flag == "--include_path":
            checked_path(value, flag, "a task YAML directory", must_exist=True)
        elif value.lstrip("-").isdecimal() and int(value) < 0:
            raise ScalestudyError(f"--num_fewshot {value}: a number of demonstrations >= 0")


def _hold_logs() -> None:
    """Route lm-eval's log into memory, to its own handlers once the model starts."""
    from lm_eval.utils import setup_logging

    setup_logging()
    logger = logging.getLogger("lm_eval")
    targets = list(logger.handlers)
    held = logging.handlers.MemoryHandler(1 << 30, flushLevel=logging.CRITICAL + 1)
    for handler in targets:
        logger.removeHandler(handler)
    logger.addHandler(held)
    _log_held.append(held)

    def give_out(flush: bool = True) -> None:
        logger.removeHandler(held)
        for handler in targets:
            logger.addHandler(handler)
        for record in held.buffer if flush else ():
            for handler in (h for h in targets if record.levelno >= h.level):
                handler.handle(record)
        held.buffer.clear()
        held.close()

    held.give_out = give_out  # type: ignore[attr-defined]


def _release_logs() -> None:
    """lm-eval accepted the command (it starts the model): its held log goes out now."""
    while _log_held:
        _log_held.pop().give_out()  # type: ignore[attr-defined]
