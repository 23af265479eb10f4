"""The synthetic corpus and its zero-shot probes: deterministic, consistent, learnable."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from scalestudy.config.experiment import SyntheticConfig
from scalestudy.data import synthetic
from scalestudy.data.objectives import Objective
from scalestudy.data.pipeline import scoring_batch
from scalestudy.data.vocab import get_vocabulary
from scalestudy.evaluate.rank import scoring_config
from scalestudy.evaluate.tasks import load_task
from scalestudy.study.run.main_job import expand, load_study

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "studies" / "smoke.yaml"


def test_synthetic_is_deterministic_and_prefix_stable():
    cfg = SyntheticConfig(n_train_documents=300, seed=5)
    docs = [synthetic.story(5, "train", i) for i in range(300)]
    assert docs == synthetic.documents(cfg, "train")
    assert docs[:10] == synthetic.documents(cfg.replace(n_train_documents=10), "train")
    val = synthetic.documents(cfg, "validation")
    assert not set(val) & set(docs)
    assert synthetic.story(6, "train", 0) != docs[0]


def test_stories_keep_their_entities_and_numbers_consistent():
    for i in range(200):
        doc = synthetic.story(0, "train", i)
        name = doc.split(" named ")[1].split(".")[0]
        color, obj = re.search(rf"{name} had an? (\w+) (\w+)\.", doc).groups()
        assert color in synthetic._COLORS and obj in synthetic._OBJECTS
        # every mention of the hero's object carries the colour introduced at the start
        assert set(re.findall(rf"(\w+) {obj}\b", doc)) <= {color, "a", "an"}, doc
        words = set(re.findall(r"\w+", doc))
        assert not {"She", "she", "her"} & words or not {"He", "he", "his"} & words, doc
        girl = name in synthetic._GIRLS
        assert (f"{'She' if girl else 'He'} loved {'her' if girl else 'his'}") in doc
        for said in re.findall(r"counted: ([a-z, ]+)\.", doc):
            n = len(said.split(", "))
            assert said == ", ".join(synthetic._NUMBERS[:n]), doc
        for before, after in re.findall(r"had (\w+) \w+\. \w+ ate one\. Now \w+ had (\w+)", doc):
            nums = synthetic._NUMBERS
            assert nums.index(after) == nums.index(before) - 1, doc


def test_probes_are_pieces_of_held_out_stories_with_one_right_answer():
    tasks = synthetic.probe_tasks(SyntheticConfig(), n=60)
    assert list(tasks) == list(synthetic.PROBE_TASKS)
    stories = [synthetic.story(1234, "probe", i) for i in range(60)]
    train = set(synthetic.documents(SyntheticConfig(n_train_documents=2000), "train"))
    assert not train & set(stories)
    for name, items in tasks.items():
        assert len(items) == 60
        assert len({t["gold"] for t in items}) == synthetic.PROBE_TASKS[name], name
        for story, t in zip(stories, items, strict=True):
            choices = t["choices"]
            assert len(set(choices)) == len(choices) == synthetic.PROBE_TASKS[name]
            assert t["evidence"] in t["context"]
            # the right continuation is what the story says; no wrong one appears there
            for j, choice in enumerate(choices):
                assert (f"{t['context']} {choice}" in story) == (j == t["gold"]), (name, t)
    assert synthetic.probe_tasks(SyntheticConfig(), n=60) == tasks


def test_probe_answers_follow_from_their_evidence():
    tasks = synthetic.probe_tasks(SyntheticConfig(), n=100)
    nums = synthetic._NUMBERS
    for t in tasks["next_number"]:
        assert t["choices"][t["gold"]] == nums[nums.index(t["evidence"]) + 1]
    for t in tasks["pronoun"]:
        his = {"She": "her", "He": "his"}[t["evidence"]]
        assert t["choices"][t["gold"]].startswith(his + " ")
        assert t["context"].endswith(f"{t['evidence']} loved")
    for t in tasks["object_color"]:
        assert t["choices"][t["gold"]].startswith(t["evidence"] + " ")
    for t in tasks["friend_name"]:
        assert t["choices"][t["gold"]] == t["evidence"] + '!"'
    for t in tasks["one_fewer"]:
        assert t["choices"][t["gold"]].split()[0] == nums[nums.index(t["evidence"]) - 1]


@pytest.mark.parametrize("objective", ["flm", "plm", "mlm"])
def test_probe_evidence_lies_inside_a_training_row_of_the_smoke_study(objective):
    """Each probe's deciding evidence and its longest choice fit in one training piece of
    every smoke cell, tokenised as the study tokenises; scoring cuts no context."""
    runs = [r for r in expand(load_study(SMOKE)) if r.cfg.objective.name == objective]
    assert runs
    probes = synthetic.probe_tasks(runs[0].cfg.data.synthetic, runs[0].cfg.eval.max_examples)
    for items in probes.values():  # a 10-point gain over chance lies outside the 95% interval
        p = 1.0 / len(items[0]["choices"]) + 0.1
        assert 1.96 * math.sqrt(p * (1 - p) / len(items)) < 0.1
    task = load_task("synthetic_probes", synthetic=runs[0].cfg.data.synthetic)
    for cfg in {r.cfg.model.arch: r.cfg for r in runs}.values():
        vocab = get_vocabulary(cfg.data)
        piece = Objective(cfg.objective, cfg.model.vocab_size, cfg.data.extra_ids, 0).piece_length
        for name, items in probes.items():
            for t in items:
                start = t["context"].index(t["evidence"])
                tail = t["context"][start:] + " " + max(t["choices"], key=len)
                assert len(vocab.encode(tail)) <= piece, (cfg.model.arch, name, t)
        inputs = [vocab.encode(c) for ex in task.examples for c, _ in ex.pairs()]
        targets = [vocab.encode(" " + x) for ex in task.examples for _, x in ex.pairs()]
        _, n_cut = scoring_batch(scoring_config(cfg), inputs, targets)
        assert n_cut == 0, cfg.model.arch


def test_incontext_items_span_episodes_twin_balanced_in_any_even_prefix():
    cfg = SyntheticConfig()
    items = synthetic.incontext_probe(cfg)
    assert len(items) == 640
    for n in (2, 40, 160, 320, 640):
        head = items[:n]
        assert len({t["episode"][:-1] for t in head}) == min(n // 2, 80)
        assert sum(t["gold"] for t in head) == n // 2  # twins side by side: chance at K = 0
    for a, b in zip(items[::2], items[1::2], strict=True):  # a twin pair: one prompt, two answers
        assert (a["context"], a["choices"]) == (b["context"], b["choices"])
        assert a["gold"] != b["gold"] and a["episode"][:-1] == b["episode"][:-1]


def test_incontext_demonstrations_show_the_episodes_rule_never_a_scored_word_and_fit_a_row():
    """The pool: each demonstration word of an episode PROBE_LINES_PER_WORD times with the
    colour right in that episode (twin); no line names a word the episode scores, so no
    prompt holds a scored question; eight of its longest lines, the question and its longest
    answer stay within a smoke training row of 128 bytes."""
    cfg = SyntheticConfig()
    items = synthetic.incontext_probe(cfg)
    demos = synthetic.incontext_demonstrations(cfg)
    right = {t["episode"]: t["choices"][t["gold"]] for t in items}
    questions: dict[str, set[str]] = {}
    for t in items:
        questions.setdefault(t["episode"], set()).add(t["context"])
    seen: dict[tuple[str, str], int] = {}
    for d in demos:
        assert d["answer"] == right[d["episode"]]
        assert d["context"] not in questions[d["episode"]], d  # never the scored question
        seen[(d["episode"], d["context"])] = seen.get((d["episode"], d["context"]), 0) + 1
    assert {e for e, _ in seen} == set(right)
    assert set(seen.values()) == {synthetic.PROBE_LINES_PER_WORD}
    assert all(sum(e == x for x, _ in seen) == synthetic.PROBE_SCORED_WORDS for e in right)
    delimiter = synthetic.INCONTEXT_DELIMITER
    longest = max(len(f"{d['context']} {d['answer']}{delimiter}".encode()) for d in demos)
    question = max(len(t["context"].encode()) + 1 + len(max(t["choices"], key=len)) for t in items)
    assert 8 * longest + question <= 128 - 2  # room for span corruption's EOS and sentinel
