"""Harness prompts: one function per task turning a release row into an `Example`.

The prompts are those of the public evaluation harness (EleutherAI lm-evaluation-harness) for
each task. Every builder accepts the released file's fields and, where they differ, the field
names of the TFDS/HF version of the dataset, so the same task reads from either source.
Files already in harness form (`{query, choices, gold}`) are taken as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from scalestudy.evaluate.examples import Example
from scalestudy.evaluate.formats import Row


def gold_index(row: Row, field: str, choices: tuple[str, ...], names: tuple = ()) -> int:
    """The gold label as an index into `choices`: an int, a bool, a digit string, one of
    `names` (label values in choice order), or the text of a choice."""
    value = row.get(field, (int, str, bool))
    n = len(choices)
    if isinstance(value, bool):
        value = int(value)
    elif isinstance(value, str):
        stripped = value.strip()
        if names and stripped in names:
            value = list(names).index(stripped)
            if value >= n:
                raise row.error(
                    f"field {field!r}: label {stripped!r} is label_names entry {value}, but "
                    f"the row has {n} choices; give one label name per choice"
                )
            return value
        if stripped in choices:
            return choices.index(stripped)
        if stripped.lstrip("-").isdigit():
            value = int(stripped)
        else:
            accepted = list(names) if names else list(choices)
            raise row.error(f"field {field!r}: label {value!r} is none of {accepted}")
    if not 0 <= value < n:
        raise row.error(
            f"field {field!r}: gold label {value} out of range for {n} choices "
            f"(accepted 0..{n - 1})"
        )
    return value


def check_choices(row: Row, choices: tuple[str, ...], field: str) -> tuple[str, ...]:
    """`choices` if there are at least two, all non-empty strings; a row error otherwise."""
    if len(choices) < 2:
        raise row.error(f"field {field!r}: need at least 2 choices, got {len(choices)}")
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            raise row.error(f"field {field!r}: choice {i} is {type(c).__name__}, not text")
        if not c.strip():
            raise row.error(f"field {field!r}: choice {i} is empty")
    return choices


def _harness_form(row: Row, suffix: str = "") -> Example:
    """A `{query, choices, gold}` row, the prompt already applied (plus `suffix` if missing)."""
    query = row.get("query", str)
    if suffix and not query.rstrip().endswith(suffix.strip()):
        query += suffix
    choices = check_choices(row, tuple(row.get("choices", list)), "choices")
    return Example((query,), choices, gold_index(row, "gold", choices))


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def copa(row: Row) -> Example:
    if "query" in row.fields:
        return _harness_form(row)
    premise = row.get("premise", str).strip()
    question = row.get("question", str)
    connectors = {"cause": "because", "effect": "therefore"}
    if question not in connectors:
        raise row.error(f"field 'question' is {question!r}; accepted: cause, effect")
    context = f"{premise.removesuffix('.')} {connectors[question]}"
    fields = ("choice1", "choice2")
    choices = check_choices(row, tuple(_lower_first(row.get(f, str)) for f in fields), "choice*")
    return Example((context,), choices, gold_index(row, "label", choices))


def piqa(row: Row) -> Example:
    if "query" in row.fields:
        return _harness_form(row)
    context = f"Question: {row.get('goal', str)}\nAnswer:"
    choices = check_choices(row, (row.get("sol1", str), row.get("sol2", str)), "sol*")
    return Example((context,), choices, gold_index(row, "label", choices))


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(row: Row) -> Example:
    if "query" in row.fields:
        context = row.get("query", str)
    else:  # TFDS/HF fields
        ctx = row.get("context" if "context" in row.fields else "ctx", str)
        context = f"{row.get('activity_label', str)}: {ctx}"
    choices = tuple(_hellaswag_clean(e) for e in row.get("endings", list))
    choices = check_choices(row, choices, "endings")
    field = "label" if "label" in row.fields else "gold"
    return Example((_hellaswag_clean(context),), choices, gold_index(row, field, choices))


def boolq(row: Row) -> Example:
    if "query" in row.fields:
        return _harness_form(row, "\nAnswer:")
    context = f"{row.get('passage', str)}\nQuestion: {row.get('question', str)}?\nAnswer:"
    choices = ("no", "yes")
    return Example((context,), choices, gold_index(row, "label", choices))


def _question_choices(row: Row) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(stem, choice texts, choice labels) of the AI2 release form (ARC, OpenBookQA):
    {"question": {"stem", "choices": [{"text", "label"}, ...]}, "answerKey"}."""
    question = Row(row.get("question", dict), row.where)
    items = question.get("choices", list)
    texts = tuple(Row(c, row.where).get("text", str) for c in items)
    labels = tuple(str(Row(c, row.where).get("label", (str, int))) for c in items)
    return question.get("stem", str), check_choices(row, texts, "question.choices"), labels


def arc(row: Row) -> Example:
    if "query" in row.fields:
        return _harness_form(row, "\nAnswer:")
    if isinstance(row.fields.get("question"), dict):  # the original release
        stem, choices, keys = _question_choices(row)
        context = f"Question: {stem}\nAnswer:"
        return Example((context,), choices, gold_index(row, "answerKey", choices, keys))
    choice_obj = row.get("choices", dict)
    choices = check_choices(row, tuple(choice_obj.get("text", ())), "choices.text")
    keys = tuple(str(k) for k in choice_obj.get("label", ()))
    context = f"Question: {row.get('question', str)}\nAnswer:"
    return Example((context,), choices, gold_index(row, "answerKey", choices, keys))


def winogrande(row: Row) -> Example:
    if "context_options" in row.fields:
        options = tuple(row.get("context_options", list))
        check_choices(row, options, "context_options")
        continuation = row.get("continuation", str)
        gold = gold_index(row, "gold", options)
    else:  # TFDS/HF fields: sentence with a blank "_", option1, option2
        sentence = row.get("sentence", str)
        if "_" not in sentence:
            raise row.error("field 'sentence' has no blank '_' to fill")
        cut = sentence.index("_")
        options = tuple(sentence[:cut] + row.get(f, str) for f in ("option1", "option2"))
        continuation = sentence[cut + 1 :].strip()
        field = "answer" if "answer" in row.fields else "label"
        gold = gold_index(row, field, ("1", "2") if field == "answer" else options, ("1", "2"))
    if not continuation.strip():
        raise row.error("the shared continuation is empty")
    return Example(options, (continuation,) * len(options), gold)


def lambada(row: Row) -> Example:
    if "text" in row.fields and "context" not in row.fields:
        context, _, word = row.get("text", str).rpartition(" ")
    else:
        context, word = row.get("context", str), row.get("continuation", str)
    if not word.strip():
        raise row.error("the target word ('continuation') is empty")
    return Example((context,), (word,))


def rte(row: Row) -> Example:
    context = (
        f"{row.get('premise', str)}\nQuestion: {row.get('hypothesis', str)} True or False?\nAnswer:"
    )
    choices = ("True", "False")
    return Example((context,), choices, gold_index(row, "label", choices, RTE_LABELS))


def cb(row: Row) -> Example:
    context = (
        f"{row.get('premise', str)}\nQuestion: {row.get('hypothesis', str)}. "
        "True, False, or Neither?\nAnswer:"
    )
    choices = ("True", "False", "Neither")
    return Example((context,), choices, gold_index(row, "label", choices, CB_LABELS))


def wic(row: Row) -> Example:
    s1, s2 = row.get("sentence1", str), row.get("sentence2", str)
    if "start1" in row.fields:
        word = s1[row.get("start1", int) : row.get("end1", int)]
    else:
        tokens, i = s1.split(" "), row.get("word_index1", int)
        if not 0 <= i < len(tokens):
            raise row.error(f"field 'word_index1'={i} outside sentence1's {len(tokens)} words")
        word = tokens[i]
    context = (
        f"Sentence 1: {s1}\nSentence 2: {s2}\nQuestion: Is the word '{word}' used in the same "
        "way in the two sentences above?\nAnswer:"
    )
    choices = ("no", "yes")
    return Example((context,), choices, gold_index(row, "label", choices))


def _detokenize(text: str) -> str:
    """Undo the release's whitespace tokenisation around punctuation and quotes."""
    text = text.replace(" n't", "n't").replace(" 's", "'s").replace("( ", "(").replace(" )", ")")
    text = text.replace('" ', '"').replace(' "', '"')
    return re.sub(r" ([.,;:?!])", r"\1", text)


def wsc(row: Row) -> Example:
    target = Row(row.fields["target"], row.where) if "target" in row.fields else row
    text = row.get("text", str)
    pronoun, noun = target.get("span2_text", str), target.get("span1_text", str)
    before = " ".join(text.split()[: target.get("span2_index", int)])
    after = text[len(before) + len(pronoun) + 1 :]
    passage = _detokenize(f"{before} *{pronoun}*{after}")
    context = (
        f"Passage: {passage}\nQuestion: In the passage above, does the pronoun "
        f'"*{pronoun}*" refer to "*{noun}*"?\nAnswer:'
    )
    choices = ("no", "yes")
    return Example((context,), choices, gold_index(row, "label", choices))


def openbookqa(row: Row) -> Example:
    if isinstance(row.fields.get("question"), dict):  # the original release
        stem, choices, keys = _question_choices(row)
    else:  # TFDS/HF fields
        stem, choice_obj = row.get("question_stem", str), row.get("choices", dict)
        choices = check_choices(row, tuple(choice_obj.get("text", ())), "choices.text")
        keys = tuple(str(k) for k in choice_obj.get("label", ()))
    return Example((stem,), choices, gold_index(row, "answerKey", choices, keys))


def anli(row: Row) -> Example:
    premise = row.get("context" if "context" in row.fields else "premise", str)
    context = f"{premise}\nQuestion: {row.get('hypothesis', str)} True, False, or Neither?\nAnswer:"
    choices = ("True", "Neither", "False")
    return Example((context,), choices, gold_index(row, "label", choices, ANLI_LABELS))


def story_cloze(row: Row) -> Example:
    if "InputSentence1" in row.fields:  # the released CSV
        story = [row.get(f"InputSentence{i}", str) for i in range(1, 5)]
        endings = ("RandomFifthSentenceQuiz1", "RandomFifthSentenceQuiz2")
        label = "AnswerRightEnding"
    else:  # TFDS/HF fields
        story = [row.get(f"input_sentence_{i}", str) for i in range(1, 5)]
        endings, label = ("sentence_quiz1", "sentence_quiz2"), "answer_right_ending"
    choices = check_choices(row, tuple(row.get(f, str) for f in endings), "endings")
    gold = gold_index(Row({label: int(row.get(label, (int, str))) - 1}, row.where), label, choices)
    return Example((" ".join(s.strip() for s in story),), choices, gold)


def sciq(row: Row) -> Example:
    context = f"{row.get('support', str)}\nQuestion: {row.get('question', str)}\nAnswer:".strip()
    fields = ("distractor1", "distractor2", "distractor3", "correct_answer")
    choices = check_choices(row, tuple(row.get(f, str) for f in fields), "distractor*")
    return Example((context,), choices, 3)


def _pick(row: Row, *names: str) -> str:
    """The first of `names` the row has (release and TFDS spell some fields differently)."""
    return row.get(next((n for n in names if n in row.fields), names[0]), str)


def mrpc(row: Row) -> Example:
    s1, s2 = _pick(row, "#1 String", "sentence1"), _pick(row, "#2 String", "sentence2")
    context = (
        f"Sentence 1: {s1}\nSentence 2: {s2}\nQuestion: Do both sentences mean the same "
        "thing?\nAnswer:"
    )
    choices = ("no", "yes")
    field = "Quality" if "Quality" in row.fields else "label"
    return Example((context,), choices, gold_index(row, field, choices))


def qnli(row: Row) -> Example:
    context = (
        f"{row.get('question', str)}\n{row.get('sentence', str)}\nQuestion: Does this "
        "response answer the question?\nAnswer:"
    )
    choices = ("yes", "no")
    return Example((context,), choices, gold_index(row, "label", choices, RTE_LABELS))


def sst2(row: Row) -> Example:
    question = "Question: Is this sentence positive or negative?\nAnswer:"
    context = f"{row.get('sentence', str).strip()}\n{question}"
    choices = ("negative", "positive")
    return Example((context,), choices, gold_index(row, "label", choices))


def wnli(row: Row) -> Example:
    hypothesis = row.get("sentence2", str)
    context = f"{row.get('sentence1', str)}\nQuestion: {hypothesis} True or False?\nAnswer:"
    choices = ("False", "True")
    return Example((context,), choices, gold_index(row, "label", choices))


def qqp(row: Row) -> Example:
    context = (
        f"Question 1: {row.get('question1', str)}\nQuestion 2: {row.get('question2', str)}\n"
        "Question: Do both questions ask the same thing?\nAnswer:"
    )
    choices = ("no", "yes")
    field = "is_duplicate" if "is_duplicate" in row.fields else "label"
    return Example((context,), choices, gold_index(row, field, choices))


def pubmedqa(row: Row) -> Example:
    if "QUESTION" in row.fields:  # the release's ori_pqal.json
        contexts, question = row.get("CONTEXTS", list), row.get("QUESTION", str)
    else:  # TFDS/HF fields
        contexts = Row(row.get("context", dict), row.where).get("contexts", list)
        question = row.get("question", str)
    context = "Abstract: " + "\n".join(contexts) + f"\nQuestion: {question}\nAnswer:"
    choices = ("yes", "no", "maybe")
    return Example((context,), choices, gold_index(row, "final_decision", choices))


def mathqa(row: Row) -> Example:
    options = re.findall(r"[abcd] \) .*?, |e \) .*?$", row.get("options", str))
    choices = check_choices(row, tuple(o[4:].rstrip(" ,") for o in options), "options")
    letters = tuple("abcde"[: len(choices)])
    context = f"Question: {row.get('Problem', str)}\nAnswer:"
    return Example((context,), choices, gold_index(row, "correct", choices, letters))


def logiqa(row: Row) -> Example:
    options = check_choices(row, tuple(row.get("options", list)), "options")
    listed = "".join(f"{'ABCD'[i]}. {o}\n" for i, o in enumerate(options))
    context = (
        f"Passage: {row.get('context', str)}\nQuestion: {row.get('question', str)}\n"
        f"Choices:\n{listed}Answer:"
    )
    return Example((context,), options, gold_index(row, "label", options, ("a", "b", "c", "d")))


def generic(row: Row) -> Example:
    """`{query, choices, gold}` rows (any task already in harness form)."""
    return _harness_form(row)


RTE_LABELS = ("entailment", "not_entailment")
ANLI_LABELS = ("e", "n", "c")  # the release's letters, in the order of the choices
CB_LABELS = ("entailment", "contradiction", "neutral")
BUILDERS: dict[str, Callable[[Row], Example]] = {
    "copa": copa,
    "piqa": piqa,
    "hellaswag": hellaswag,
    "boolq": boolq,
    "arc_easy": arc,
    "arc_challenge": arc,
    "winogrande": winogrande,
    "lambada": lambada,
    "rte": rte,
    "cb": cb,
    "wic": wic,
    "wsc": wsc,
    "anli_r1": anli,
    "anli_r2": anli,
    "anli_r3": anli,
    "story_cloze": story_cloze,
    "openbookqa": openbookqa,
    "sciq": sciq,
    "mrpc": mrpc,
    "qnli": qnli,
    "sst2": sst2,
    "wnli": wnli,
    "qqp": qqp,
    "pubmedqa": pubmedqa,
    "mathqa": mathqa,
    "logiqa": logiqa,
    "mc": generic,
}
