"""Scored pairs are tokenised as lm-evaluation-harness tokenises them: the context's trailing
whitespace moves into the continuation; decoder-only models encode the pair as one text and
split it at the context's tokens, the encoder-decoder encodes the two apart. The byte
vocabulary's tokens are those of encoding each part alone."""

from __future__ import annotations

import functools

import pytest

from scalestudy.data import synthetic
from scalestudy.data.pipeline import encode_scoring_pair
from scalestudy.data.vocab import (
    ByteVocabulary,
    SentencePieceVocabulary,
    encode_pair,
    train_sentencepiece,
)
from scalestudy.evaluate.examples import Example, Task
from scalestudy.evaluate.pairs import tokenize_pairs

from .tiny_models import tiny

# Leading and trailing spaces on either side, punctuation straight after the context, a
# context of spaces only, and a continuation that starts a new word.
PAIRS = [
    ("The sky is blue", "."),
    ("Hi", ", hello there"),
    ("The sky is ", "blue."),
    ("Two plus two is  ", " four"),
    ("Question: what is it?\nAnswer:", " a red hen"),
    ("   ", "cold"),
    ("Cats like to", " sleep all day"),
]


@pytest.fixture(scope="module")
def spm_vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    text = folder / "train.txt"
    text.write_text("\n".join(synthetic.story(0, "train", i) for i in range(300)))
    model = train_sentencepiece([text], folder / "tiny.model", vocab_size=200)
    return SentencePieceVocabulary(model)


def _pieces(vocab, ids: list[int]) -> list[str]:
    return [vocab.tokenizer.IdToPiece(i) for i in ids]


def test_byte_pairs_are_each_part_encoded_alone() -> None:
    vocab = ByteVocabulary()
    for context, continuation in PAIRS:
        for joint in (True, False):
            got = encode_pair(vocab, context, continuation, joint=joint)
            moved = len(context) - len(context.rstrip())
            want_context = vocab.encode(context.rstrip())
            assert got == (
                want_context,
                vocab.encode(context[len(context) - moved :] + continuation),
            )
            # Nothing lost or added: the two parts are the whole text's bytes.
            assert got[0] + got[1] == vocab.encode(context + continuation)
        if context == context.rstrip():  # what scoring did before: unchanged
            assert encode_pair(vocab, context, continuation, joint=True) == (
                vocab.encode(context),
                vocab.encode(continuation),
            )


def test_sentencepiece_joint_split_drops_the_spurious_word_mark(spm_vocab) -> None:
    # Encoded alone, "." and ", hello" start with SentencePiece's word mark; read after the
    # context, as the model saw such text in training, they do not.
    for context, continuation in PAIRS[:2]:
        _, joint = encode_pair(spm_vocab, context, continuation, joint=True)
        _, apart = encode_pair(spm_vocab, context, continuation, joint=False)
        assert _pieces(spm_vocab, apart)[0] == "\u2581"
        assert _pieces(spm_vocab, joint)[0] != "\u2581"
        assert spm_vocab.decode(joint) == continuation.strip()


def test_sentencepiece_split_equals_lm_eval(spm_vocab) -> None:
    """lm-eval's own `TemplateLM._encode_pair` over the same tokeniser, for both backends."""
    model_api = pytest.importorskip("lm_eval.api.model", reason="lm-eval is not installed")

    class Harness(model_api.TemplateLM):
        def __init__(self, backend: str) -> None:
            super().__init__()
            self.backend = backend

        @property
        def eot_token_id(self) -> int:
            return spm_vocab.eos_id

        def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
            return spm_vocab.encode(string)

        def _loglikelihood_tokens(self, requests, **kwargs):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

    differs = 0
    for backend, joint in (("causal", True), ("seq2seq", False)):
        theirs = Harness(backend)
        for context, continuation in PAIRS:
            ours = encode_pair(spm_vocab, context, continuation, joint=joint)
            if not context.strip():  # lm-eval reads an empty context as a start token
                assert ours == ([], spm_vocab.encode(context + continuation))
                continue
            assert ours == tuple(theirs._encode_pair(context, continuation)), (context, backend)
            differs += ours[1] != spm_vocab.encode(continuation)
    assert differs >= 2  # the rule changes real pairs ("." and ", hello there"), not none


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_the_scorer_tokenises_as_the_adapter(arch, spm_vocab) -> None:
    """`scalestudy eval`'s pairs (tokenize_pairs) follow the architecture's rule."""
    cfg = tiny(arch, "plm" if arch != "causal_decoder" else "flm")
    task = Task(
        name="t",
        kind="choice",
        examples=(Example(("The sky is",), ("blue.", "green, hello")),),
        source="test",
        delimiter=" ",
    )
    inputs, targets, _ = tokenize_pairs(
        functools.partial(encode_scoring_pair, cfg, spm_vocab), task, list(task.examples)
    )
    joint = not cfg.model.is_encoder_decoder
    want = [
        encode_pair(spm_vocab, "The sky is", " " + c, joint=joint) for c in task.examples[0].choices
    ]
    assert list(zip(inputs, targets, strict=True)) == want
