"""An order-sensitive corpus for position-encoding experiments (`data.source: order`).

Each document is a random string of letters, a bar, and the same string reversed: `hbfa|afbh`.
The reversed half is a deterministic function of the *order* of the first half, not of its
letters as a bag, so a model that cannot tell positions apart in its bidirectional prefix (a
non-causal decoder without position encoding) cannot predict it from the prefix, while a causal
model can still recover order from its mask. The alphabet is small and the strings short so
that a small model learns the reversal in a few hundred CPU steps (a task nobody learns cannot
tell a slower learner from a worse one). A string belongs to the validation split when a hash
of it says so, so no validation string is ever a training string (with 8 letters, short
strings repeat often). Documents are a pure function of (`data.synthetic.seed`, split, index),
like the synthetic corpus, whose sizes they reuse.
"""

from __future__ import annotations

import random
import zlib

from scalestudy.config.experiment import SyntheticConfig

LETTERS = "abcdefgh"
LENGTHS = (4, 8)  # letters in the first half, uniform in [4, 8]
VALIDATION_SHARE = 16  # one string in 16 is reserved for validation (by its hash)
_SPLIT_SALT = {"train": 11, "validation": 12}


def is_validation(letters: str) -> bool:
    """Whether the string `letters` is reserved for the validation split."""
    return zlib.crc32(letters.encode()) % VALIDATION_SHARE == 0


def document(seed: int, split: str, index: int) -> str:
    """Document `index` of `split`: a random string of its split, "|", the string reversed."""
    rng = random.Random((seed * 1_000_003 + _SPLIT_SALT[split]) * 1_000_003 + index)
    want = split == "validation"
    while True:  # rejection keeps the strings of each split uniform among that split's strings
        letters = "".join(rng.choice(LETTERS) for _ in range(rng.randint(*LENGTHS)))
        if is_validation(letters) == want:
            return f"{letters}|{letters[::-1]}"


def documents(cfg: SyntheticConfig, split: str) -> list[str]:
    """The documents of `split` ('train' or 'validation'), as many as the synthetic corpus."""
    n = cfg.n_train_documents if split == "train" else cfg.n_validation_documents
    return [document(cfg.seed, split, i) for i in range(n)]
