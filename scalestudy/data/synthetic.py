"""The built-in synthetic corpus: short English-like stories from a probabilistic grammar.

Structure at several ranges, so that bigger models keep finding something to learn, and every
dependency the zero-shot probes test is short: it spans at most one short episode (under 64
bytes), so it lies inside a training row of the smoke study.
- characters and words: a fixed lexicon, spelled consistently;
- counting: number words in order, and one fewer after one is eaten;
- agreement: the hero's pronouns follow the gender of the hero's name;
- copying: the hero's coloured object, the friend's name and the animal seen are repeated a few
  words after they are introduced, and the colour stays the same across the story.

Document `i` of a split is a pure function of (seed, split, i), so corpora of different sizes
share their first documents and generation needs no state. `probe_tasks` builds zero-shot
multiple-choice probes from held-out stories: pick the continuation the story's grammar gives.

With `incontext_share` > 0, that share of documents are in-context episodes instead: lines
"dax is red" over made-up words that all share one colour, drawn anew in every document, so
the only way to predict the colour of a word met for the first time is the lines before it.
`incontext_probe` asks for the colour of a word no demonstration names, which only the
episode's rule shown by the demonstrations can give (K-shot evaluation, evaluate/fewshot.py);
the demonstrations come from a pool of their own (`incontext_demonstrations`), and without
them the probe is at chance by construction.
"""

from __future__ import annotations

import functools
import random

from scalestudy.config.experiment import SyntheticConfig

_GIRLS = ["Lily", "Mia", "Sara", "Anna", "Emma", "Lucy", "Zoe", "Ella", "Rosa", "Nina", "Amy"]
_GIRLS += ["Kate", "Jane", "Ruby", "Ivy"]
_BOYS = ["Tom", "Max", "Ben", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Eli", "Oscar"]
_BOYS += ["Hugo", "Paul", "Dan", "Owen"]
_KINDS_GIRL = ["girl", "princess", "mouse", "bunny", "duck"]
_KINDS_BOY = ["boy", "prince", "puppy", "bear", "frog"]
_ADJS = ["little", "kind", "brave", "happy", "curious", "shy", "clever", "small"]
_COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white"]
_OBJECTS = ["ball", "kite", "hat", "box", "boat", "cup", "drum", "book", "key", "shoe"]
_PLACES = ["park", "forest", "garden", "beach", "farm", "lake", "hill", "town", "river"]
_ANIMALS = ["bird", "cat", "dog", "fox", "owl", "cow", "goat", "fish", "bee", "snail"]
_THINGS = ["stones", "shells", "leaves", "flowers", "sticks", "feathers"]  # counted
_FOODS = ["apples", "pears", "plums", "cakes", "nuts", "figs", "buns", "eggs"]  # eaten
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_WEATHER = ["sunny", "rainy", "windy", "snowy", "cold", "warm"]
_FEELINGS = ["happy", "sad", "scared", "excited", "tired", "surprised"]
_GREETINGS = ["Hi", "Hello", "Look"]


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


class _Story:
    """One story's entities and numbers, drawn once so that every mention agrees with them."""

    def __init__(self, rng: random.Random) -> None:
        girl = rng.random() < 0.5
        self.name = rng.choice(_GIRLS if girl else _BOYS)
        self.kind = rng.choice(_KINDS_GIRL if girl else _KINDS_BOY)
        self.he, self.his = ("she", "her") if girl else ("he", "his")
        self.He = self.he.capitalize()
        pool = [n for n in (_GIRLS if rng.random() < 0.5 else _BOYS) if n != self.name]
        self.friend = rng.choice(pool)
        self.adj = rng.choice(_ADJS)
        self.color = rng.choice(_COLORS)
        self.obj = rng.choice(_OBJECTS)
        self.place = rng.choice(_PLACES)
        self.animal = rng.choice(_ANIMALS)
        self.count = rng.randrange(2, 8)  # things counted: "one, two, ..." up to seven
        self.things = rng.choice(_THINGS)
        self.had = rng.randrange(3, 11)  # food before one is eaten: three to ten
        self.food = rng.choice(_FOODS)
        self.greeting = rng.choice(_GREETINGS)


# Episodes: each a few sentences whose dependencies stay inside the episode (<= 64 bytes).


def _own(s: _Story) -> str:
    return f"{s.name} had {_a(s.color)} {s.obj}. {s.He} loved {s.his} {s.color} {s.obj}."


def _meet(s: _Story) -> str:
    return f'{s.name} met {s.friend} at the {s.place}. "{s.greeting}, {s.friend}!"'


def _count(s: _Story) -> str:
    return f"{s.He} counted: {', '.join(_NUMBERS[: s.count])}."


def _found(s: _Story) -> str:
    return f"{s.name} found {_NUMBERS[s.count - 1]} {s.things}."


def _eat(s: _Story) -> str:
    return (
        f"{s.name} had {_NUMBERS[s.had - 1]} {s.food}. {s.He} ate one. "
        f"Now {s.he} had {_NUMBERS[s.had - 2]} {s.food}."
    )


def _animal(s: _Story, rng: random.Random) -> str:
    return f"{s.name} saw {_a(s.animal)}. The {s.animal} was {rng.choice(_FEELINGS)}."


def _lost(s: _Story) -> str:
    return f"{s.name} lost {s.his} {s.color} {s.obj}. {s.friend} found the {s.color} {s.obj}."


def _weather(s: _Story, rng: random.Random) -> str:
    return f"One {rng.choice(_WEATHER)} day, {s.name} went to the {s.place}."


def _episodes(s: _Story, rng: random.Random, every: bool) -> list[tuple[str, str]]:
    """The story's middle: its episodes in a random order, some of them twice (new numbers),
    as (kind, text) pieces.

    `every`: each kind of episode at least once (the probe split, so that every probe is a
    piece of its story)."""
    kinds = ["meet", "count", "eat", "animal", "lost", "weather"]
    picked = kinds + rng.sample(kinds, 3) if every else rng.sample(kinds * 2, rng.randrange(6, 11))
    rng.shuffle(picked)
    out = []
    for kind in picked:
        if kind == "meet":
            out.append((kind, _meet(s)))
        elif kind == "count":
            s.count, s.things = rng.randrange(2, 8), rng.choice(_THINGS)
            out += [(kind, _found(s)), (kind, _count(s))]
        elif kind == "eat":
            s.had, s.food = rng.randrange(3, 11), rng.choice(_FOODS)
            out.append((kind, _eat(s)))
        elif kind == "animal":
            out.append((kind, _animal(s, rng)))
        elif kind == "lost":
            out.append((kind, _lost(s)))
        else:
            out.append((kind, _weather(s, rng)))
    return out


def _split_salt(split: str) -> int:
    return {"train": 1, "validation": 2, "probe": 3}[split]


def _rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random((seed * 7 + _split_salt(split)) * 1_000_003 + index)


def _tell(s: _Story, rng: random.Random, every: bool) -> list[tuple[str, str]]:
    opening = f"Once upon a time, there was {_a(s.adj)} {s.kind} named {s.name}."
    ending = f"{s.name} and {s.friend} played with the {s.color} {s.obj}. The end."
    return [("opening", opening), ("own", _own(s)), *_episodes(s, rng, every), ("ending", ending)]


def story(seed: int, split: str, index: int) -> str:
    """Story `index` of `split` ('train', 'validation' or 'probe') for `seed`."""
    return " ".join(text for _, text in story_pieces(seed, split, index))


def story_pieces(seed: int, split: str, index: int) -> list[tuple[str, str]]:
    """Story `index` of `split` as (episode kind, text) pieces, in order; joined by single
    spaces they are `story(seed, split, index)`. Kinds: EPISODE_KINDS."""
    rng = _rng(seed, split, index)
    return _tell(_Story(rng), rng, every=split == "probe")


# The kinds of piece a document of the corpus is made of (`labelled_documents`).
EPISODE_KINDS = ("opening", "own", "meet", "count", "eat", "animal", "lost", "weather", "ending")
EPISODE_KINDS += ("incontext",)


# In-context episodes: made-up words (no story uses them), all given one colour per document.
_NONCE = ["dax", "wug", "blick", "fep", "zib", "lorp", "mib", "toma", "kiki", "yop", "glim"]
_NONCE += ["nup", "vek", "jora", "plim", "sorb"]
INCONTEXT_DELIMITER = "\n"  # between the lines of an episode, and between demonstrations


def _line(word: str, colour: str) -> str:
    return f"{word} is {colour}"


def incontext_episode(seed: int, split: str, index: int) -> str:
    """In-context document `index` of `split`: 16 lines over 8 made-up words, all of one
    colour drawn for this document alone.

    Every word meets its first line somewhere in the document, so the corpus teaches the rule
    (this document's colour, read off the lines before), not only the recall of a line seen
    before: the in-context probe scores words that no demonstration names."""
    rng = random.Random(_rng(seed, split, index).random() + 0.5)
    words = rng.sample(_NONCE, 8)
    colour = rng.choice(_COLORS)
    return INCONTEXT_DELIMITER.join(_line(w, colour) for w in rng.choices(words, k=16))


def _is_episode(seed: int, split: str, index: int, share: float) -> bool:
    return share > 0 and random.Random(_rng(seed, split, index).random()).random() < share


@functools.lru_cache(maxsize=8)
def _documents(seed: int, split: str, n: int, share: float = 0.0) -> tuple[str, ...]:
    return tuple(
        incontext_episode(seed, split, i)
        if _is_episode(seed, split, i, share)
        else story(seed, split, i)
        for i in range(n)
    )


def documents(cfg: SyntheticConfig, split: str) -> list[str]:
    """All documents of a split ('train' or 'validation'); cached in-process."""
    n = cfg.n_train_documents if split == "train" else cfg.n_validation_documents
    return list(_documents(cfg.seed, split, n, cfg.incontext_share))


def labelled_documents(cfg: SyntheticConfig, split: str) -> list[list[tuple[str, str]]]:
    """`documents(cfg, split)`, each as (kind, text) pieces that single spaces join into it:
    a story's episodes (EPISODE_KINDS), or one "incontext" piece."""
    n = cfg.n_train_documents if split == "train" else cfg.n_validation_documents
    share, seed = cfg.incontext_share, cfg.seed
    return [
        [("incontext", incontext_episode(seed, split, i))]
        if _is_episode(seed, split, i, share)
        else story_pieces(seed, split, i)
        for i in range(n)
    ]


# The probe's words and colours: the shortest of the corpus's (at most 4 and 5 letters), so
# that a line with its delimiter takes at most 14 bytes and eight demonstrations, the question
# and its answer fit a training row of 128 bytes (the smoke study's 96 + 32).
_PROBE_WORDS = [w for w in _NONCE if len(w) <= 4]
_PROBE_COLOURS = [c for c in _COLORS if len(c) <= 5]
PROBE_LINES_PER_WORD = 2  # each demonstration word's line in an episode's pool
PROBE_SCORED_WORDS = 4  # words an episode asks about; as many others make its demonstrations


def _probe_episode(cfg: SyntheticConfig, e: int) -> tuple[list[str], list[str], list[str]]:
    """Episode `e`'s scored words, its demonstration words (disjoint from them) and its two
    colours: twin a's rule, twin b's rule."""
    rng = _rng(cfg.seed, "probe", 1_000_000 + e)
    words = rng.sample(_PROBE_WORDS, 2 * PROBE_SCORED_WORDS)
    return words[:PROBE_SCORED_WORDS], words[PROBE_SCORED_WORDS:], rng.sample(_PROBE_COLOURS, 2)


def _episode_name(e: int, twin: int) -> str:
    return f"{e}{'ab'[twin]}"


def incontext_probe(cfg: SyntheticConfig, n_episodes: int = 80) -> list[dict]:
    """The in-context probe's scored items: {"context", "choices", "gold", "episode"}, one per
    scored word of each episode and twin (8 per episode).

    An episode draws two colours and gives all its words one of them, the one its twin does
    not: the rule of the corpus's in-context documents. An item asks "<word> is" with both
    colours as choices about a word that none of the episode's demonstrations names
    (`incontext_demonstrations`: other words, in a pool of their own), so only the rule that
    the demonstrations show can tell the right one; a prompt never holds the scored question.
    The two items of a twin read the same zero-shot prompt and choices with opposite answers,
    so any model is exactly at chance at K = 0. Items are ordered word by word across all
    episodes, twins side by side, so that the first n items (any even n) span min(n / 2,
    n_episodes) episodes and stay twin-balanced.
    """
    episodes = [_probe_episode(cfg, e) for e in range(n_episodes)]
    items = []
    for slot in range(PROBE_SCORED_WORDS):
        for e, (scored, _, colours) in enumerate(episodes):
            choices = sorted(colours)
            for twin in (0, 1):
                items.append(
                    {
                        "context": f"{scored[slot]} is",
                        "choices": choices,
                        "gold": choices.index(colours[twin]),
                        "episode": _episode_name(e, twin),
                    }
                )
    return items


def incontext_demonstrations(cfg: SyntheticConfig, n_episodes: int = 80) -> list[dict]:
    """The in-context probe's demonstration pool: {"context", "answer", "episode"} lines
    "<word> is <colour>", each demonstration word of each episode and twin
    PROBE_LINES_PER_WORD times with that twin's colour. No line names a scored word of its
    episode (`incontext_probe`): K-shot prompts draw their demonstrations from the scored
    item's episode here."""
    out = []
    for e in range(n_episodes):
        _, shown, colours = _probe_episode(cfg, e)
        for twin in (0, 1):
            episode = _episode_name(e, twin)
            for _ in range(PROBE_LINES_PER_WORD):
                out += [
                    {"context": f"{w} is", "answer": colours[twin], "episode": episode}
                    for w in shown
                ]
    return out


# ----------------------------------------------------------------------------- probes

# Easiest first (what the smallest models should reach first), each with its number of choices.
PROBE_TASKS = {
    "next_number": 4,  # the next number word while counting: the previous word decides
    "pronoun": 2,  # her/his after she/he: agreement with the subject a word before
    "object_color": 4,  # copy the colour of the object named a sentence before
    "friend_name": 4,  # copy the friend's name into the greeting
    "one_fewer": 4,  # one fewer after one is eaten: the number said before, minus one
}


def _probe(context: str, right: str, wrong: list[str], evidence: str, rng: random.Random) -> dict:
    choices = [right, *wrong]
    rng.shuffle(choices)
    return {
        "context": context,
        "choices": choices,
        "gold": choices.index(right),
        "evidence": evidence,
    }


def _others(rng: random.Random, pool: list[str], avoid: list[str], k: int) -> list[str]:
    return rng.sample([p for p in pool if p not in avoid], k)


def probe_tasks(cfg: SyntheticConfig, n: int = 400) -> dict[str, list[dict]]:
    """Zero-shot probes on held-out stories: {task: [{"context", "choices", "gold", "evidence"}]}.

    Each context is the start of an episode of probe story `i` (`story(seed, "probe", i)`), and
    `context + " " + choices[gold]` is a piece of that story; the other choices break the
    story's grammar. `evidence` is the part of the context that decides the answer; the whole
    example is at most 64 bytes. Tasks, easiest first: see `PROBE_TASKS`.
    """
    tasks: dict[str, list[dict]] = {name: [] for name in PROBE_TASKS}
    for i in range(n):
        rng = _rng(cfg.seed, "probe", i)
        s = _Story(rng)
        _tell(s, rng, every=True)  # advances rng and leaves the last drawn numbers in `s`
        pick = random.Random(rng.random())
        for name, probe in _story_probes(s, pick).items():
            tasks[name].append(probe)
    return tasks


def _story_probes(s: _Story, pick: random.Random) -> dict[str, dict]:
    """One story's probe of each task. The probes draw from `pick` in this order (the choices'
    shuffles and the wrong answers), so the order below fixes every probe set."""
    his = {"he": "his", "she": "her"}
    other = "she" if s.he == "he" else "he"
    probes = {}
    probes["pronoun"] = _probe(
        f"{s.name} had {_a(s.color)} {s.obj}. {s.He} loved",
        f"{s.his} {s.color} {s.obj}.",
        [f"{his[other]} {s.color} {s.obj}."],
        s.He,
        pick,
    )
    probes["object_color"] = _probe(
        f"{s.name} had {_a(s.color)} {s.obj}. {s.He} loved {s.his}",
        f"{s.color} {s.obj}.",
        [f"{c} {s.obj}." for c in _others(pick, _COLORS, [s.color], 3)],
        s.color,
        pick,
    )
    probes["friend_name"] = _probe(
        f'{s.name} met {s.friend} at the {s.place}. "{s.greeting},',
        f'{s.friend}!"',
        [f'{f}!"' for f in _others(pick, _GIRLS + _BOYS, [s.name, s.friend], 3)],
        s.friend,
        pick,
    )
    k = pick.randrange(1, s.count)  # numbers said so far; the answer is number k + 1
    probes["next_number"] = _probe(
        f"{s.He} counted: {', '.join(_NUMBERS[:k])},",
        _NUMBERS[k],
        _others(pick, _NUMBERS[:8], [_NUMBERS[k]], 3),
        _NUMBERS[k - 1],
        pick,
    )
    before = _NUMBERS[s.had - 1]
    probes["one_fewer"] = _probe(
        f"{s.name} had {before} {s.food}. {s.He} ate one. Now {s.he} had",
        f"{_NUMBERS[s.had - 2]} {s.food}.",
        [f"{w} {s.food}." for w in _others(pick, _NUMBERS[1:], [_NUMBERS[s.had - 2]], 3)],
        before,
        pick,
    )
    return probes
