"""The built-in synthetic corpus: short English-like stories from a probabilistic grammar.

Structure at several scales, so that bigger models keep finding something to learn:
- characters and words: a fixed lexicon, spelled consistently;
- sentences: templates with agreement (pronouns follow the hero's gender);
- documents: entities introduced at the start (hero, friend, the hero's coloured object, a
  place, the weather, a count) must be referred to consistently many sentences later, and
  counting sequences must be continued correctly.

Document `i` of a split is a pure function of (seed, split, i), so corpora of different sizes
share their first documents and generation needs no state. `probe_tasks` builds zero-shot
multiple-choice probes from held-out stories: pick the continuation consistent with the story.
"""

from __future__ import annotations

import functools
import random

from scalestudy.config import SyntheticConfig

_GIRLS = [
    "Lily",
    "Mia",
    "Sara",
    "Anna",
    "Emma",
    "Lucy",
    "Zoe",
    "Ella",
    "Rosa",
    "Nina",
    "Amy",
    "Kate",
    "Jane",
    "Ruby",
    "Ivy",
]
_BOYS = [
    "Tom",
    "Max",
    "Ben",
    "Sam",
    "Leo",
    "Jack",
    "Tim",
    "Finn",
    "Noah",
    "Eli",
    "Oscar",
    "Hugo",
    "Paul",
    "Dan",
    "Owen",
]
_KINDS_GIRL = ["girl", "princess", "mouse", "bunny", "duck"]
_KINDS_BOY = ["boy", "prince", "puppy", "bear", "frog"]
_ADJS = ["little", "kind", "brave", "happy", "curious", "shy", "clever", "small"]
_COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white"]
_OBJECTS = ["ball", "kite", "hat", "box", "boat", "cup", "drum", "book", "key", "shoe"]
_PLACES = ["park", "forest", "garden", "beach", "farm", "lake", "hill", "town", "river"]
_ANIMALS = ["bird", "cat", "dog", "fox", "owl", "cow", "goat", "fish", "bee", "snail"]
_FRUITS = ["apples", "pears", "plums", "eggs", "stones", "shells", "leaves", "flowers"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_WEATHER = {  # an opening sentence and a later sentence that must agree with it
    "sunny": ("The sun was bright and warm.", "The warm sun made everyone smile."),
    "rainy": ("The rain fell all morning.", "The rain made little puddles on the ground."),
    "windy": ("The wind blew hard.", "The strong wind pushed the clouds away."),
    "snowy": ("White snow covered the ground.", "The cold snow crunched under their feet."),
}
_FEELINGS = ["happy", "sad", "scared", "excited", "tired", "surprised"]
_GREETINGS = ["Hello", "Hi", "Good morning", "Look", "Wait"]


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


class _Story:
    """One story's entities, drawn once so that every later mention agrees with them."""

    def __init__(self, rng: random.Random) -> None:
        girl = rng.random() < 0.5
        self.name = rng.choice(_GIRLS if girl else _BOYS)
        self.kind = rng.choice(_KINDS_GIRL if girl else _KINDS_BOY)
        self.he, self.his, self.him = ("she", "her", "her") if girl else ("he", "his", "him")
        self.He = self.he.capitalize()
        friend_girl = rng.random() < 0.5
        pool = [n for n in (_GIRLS if friend_girl else _BOYS) if n != self.name]
        self.friend = rng.choice(pool)
        self.adj = rng.choice(_ADJS)
        self.color = rng.choice(_COLORS)
        self.obj = rng.choice(_OBJECTS)
        self.place = rng.choice(_PLACES)
        self.animal = rng.choice(_ANIMALS)
        self.weather = rng.choice(list(_WEATHER))
        self.count = rng.randrange(2, 10)
        self.fruit = rng.choice(_FRUITS)


def _opening(s: _Story) -> list[str]:
    return [
        f"Once upon a time, there was a {s.adj} {s.kind} named {s.name}.",
        f"{s.name} had a {s.color} {s.obj}.",
        f"{s.He} loved {s.his} {s.color} {s.obj} very much.",
    ]


def _middle(s: _Story, rng: random.Random) -> list[str]:
    """Event sentences in a random order; each refers back to the story's entities."""
    events = [
        [
            f"One {s.weather} day, {s.name} went to the {s.place}.",
            _WEATHER[s.weather][0],
        ],
        [
            f"At the {s.place}, {s.name} met {s.his} friend {s.friend}.",
            f'"{rng.choice(_GREETINGS)}, {s.friend}!" said {s.name}.',
        ],
        [
            f"{s.name} saw {_a(s.animal)} near the {s.place}.",
            f"The {s.animal} was {rng.choice(_FEELINGS)}.",
            f"{s.name} gave the {s.animal} some food, and the {s.animal} was happy.",
        ],
        [
            f"{s.name} found {_NUMBERS[s.count - 1]} {s.fruit}.",
            f"{s.He} counted them: {', '.join(_NUMBERS[: s.count])}.",
            f"There were {_NUMBERS[s.count - 1]} {s.fruit} in all.",
        ],
        [
            f"Then {s.name} lost {s.his} {s.color} {s.obj}.",
            f"{s.He} was {rng.choice(['sad', 'worried', 'upset'])}.",
            f"{s.friend} helped {s.him} look for the {s.color} {s.obj}.",
            f"They found the {s.color} {s.obj} under a tree.",
        ],
    ]
    # The outing comes first (the later events happen at the place); the rest in any order.
    rest = events[1:]
    rng.shuffle(rest)
    keep = [events[0], *rest[: rng.randrange(2, len(rest) + 1)]]
    out = [sentence for group in keep for sentence in group]
    out.append(_WEATHER[s.weather][1])
    return out


def _ending(s: _Story) -> list[str]:
    return [
        f"In the end, {s.name} and {s.friend} played with the {s.color} {s.obj} at the {s.place}.",
        f"{s.name} was a very happy {s.kind}.",
    ]


def _split_salt(split: str) -> int:
    return {"train": 1, "validation": 2, "probe": 3}[split]


def story(seed: int, split: str, index: int) -> str:
    """Story `index` of `split` ('train', 'validation' or 'probe') for `seed`."""
    rng = random.Random((seed * 7 + _split_salt(split)) * 1_000_003 + index)
    s = _Story(rng)
    return " ".join(_opening(s) + _middle(s, rng) + _ending(s))


@functools.lru_cache(maxsize=8)
def _documents(seed: int, split: str, n: int) -> tuple[str, ...]:
    return tuple(story(seed, split, i) for i in range(n))


def documents(cfg: SyntheticConfig, split: str) -> list[str]:
    """All documents of a split ('train' or 'validation'); cached in-process."""
    n = cfg.n_train_documents if split == "train" else cfg.n_validation_documents
    return list(_documents(cfg.seed, split, n))


# ----------------------------------------------------------------------------- probes


def _probe(context: str, right: str, wrong: list[str], rng: random.Random) -> dict:
    choices = [right, *wrong]
    rng.shuffle(choices)
    return {"context": context, "choices": choices, "gold": choices.index(right)}


def _distinct(rng: random.Random, pool: list[str], avoid: str, k: int) -> list[str]:
    return rng.sample([p for p in pool if p != avoid], k)


def probe_tasks(cfg: SyntheticConfig, n: int = 200) -> dict[str, list[dict]]:
    """Zero-shot probes on held-out stories: {task: [{"context", "choices", "gold"}]}.

    Each context is a story prefix; the choices are continuations (score them as
    `context + " " + choice`) of which exactly one, `choices[gold]`, agrees with the story.
    - `pronoun`: the pronoun that agrees with the hero (2 choices);
    - `object_color`: the colour of the hero's object, introduced sentences earlier (4);
    - `friend_name`: the friend met earlier, in the closing sentence (4);
    - `counting`: the next number of a counting sequence (4).
    """
    tasks: dict[str, list[dict]] = {
        "pronoun": [],
        "object_color": [],
        "friend_name": [],
        "counting": [],
    }
    for i in range(n):
        rng = random.Random((cfg.seed * 7 + _split_salt("probe")) * 1_000_003 + i)
        s = _Story(rng)
        head = " ".join(_opening(s)[:2])
        she, he = ("she", "he") if s.he == "she" else ("he", "she")
        tasks["pronoun"].append(
            _probe(
                f"Once upon a time, there was a {s.adj} {s.kind} named {s.name}. {s.name} "
                f"had a {s.color} {s.obj}. One day,",
                f"{she} went to the {s.place}.",
                [f"{he} went to the {s.place}."],
                rng,
            )
        )
        middle = " ".join(_middle(s, rng)[:4])
        tasks["object_color"].append(
            _probe(
                f"{head} {middle} In the end, {s.name} and {s.friend} played with the",
                f"{s.color} {s.obj}.",
                [f"{c} {s.obj}." for c in _distinct(rng, _COLORS, s.color, 3)],
                rng,
            )
        )
        pool = _GIRLS + _BOYS
        tasks["friend_name"].append(
            _probe(
                f"{head} At the {s.place}, {s.name} met {s.his} friend {s.friend}. "
                f"{_WEATHER[s.weather][0]} In the end, {s.name} and",
                f"{s.friend} played at the {s.place}.",
                [
                    f"{f} played at the {s.place}."
                    for f in _distinct(rng, [p for p in pool if p != s.name], s.friend, 3)
                ],
                rng,
            )
        )
        k = rng.randrange(2, 9)  # counted so far; the answer is the (k+1)-th number
        tasks["counting"].append(
            _probe(
                f"{head} {s.name} found {_NUMBERS[k]} {s.fruit}. {s.He} counted them: "
                f"{', '.join(_NUMBERS[:k])},",
                f"{_NUMBERS[k]}.",
                [f"{w}." for w in _distinct(rng, _NUMBERS, _NUMBERS[k], 3)],
                rng,
            )
        )
    return tasks
