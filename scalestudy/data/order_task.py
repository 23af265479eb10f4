"""An order-sensitive corpus for position-encoding experiments (`data.source: order`).

Each document is a random string of lowercase letters, a bar, and the same string reversed:
`qzkf|fkzq`. The reversed half is a deterministic function of the *order* of the first half,
not of its letters as a bag, so a model that cannot tell positions apart in its bidirectional
prefix (a non-causal decoder without position encoding) cannot predict it from the prefix,
while a causal model can still recover order from its mask. Documents are a pure function of
(`data.synthetic.seed`, split, index), like the synthetic corpus, whose sizes they reuse.
"""

from __future__ import annotations

import random

from scalestudy.config import SyntheticConfig

LETTERS = "abcdefghijklmnopqrstuvwxyz"
LENGTHS = (6, 14)  # letters in the first half, uniform in [6, 14]
_SPLIT_SALT = {"train": 11, "validation": 12}


def document(seed: int, split: str, index: int) -> str:
    """Document `index` of `split`: a random string, "|", the string reversed."""
    rng = random.Random((seed * 1_000_003 + _SPLIT_SALT[split]) * 1_000_003 + index)
    letters = "".join(rng.choice(LETTERS) for _ in range(rng.randint(*LENGTHS)))
    return f"{letters}|{letters[::-1]}"


def documents(cfg: SyntheticConfig, split: str) -> list[str]:
    """The documents of `split` ('train' or 'validation'), as many as the synthetic corpus."""
    n = cfg.n_train_documents if split == "train" else cfg.n_validation_documents
    return [document(cfg.seed, split, i) for i in range(n)]
