"""A synthetic training corpus generated from a small grammar, so examples need no downloads.

Four kinds of documents, each with regularities a tiny language model can pick up quickly:

- stories: sentences with subject-verb number agreement and "a"/"an" before vowels;
- arithmetic: correct sums, differences and products of one-digit numbers;
- records: key-value lines with increasing ids, where each name always lives in the same town;
- counting: arithmetic progressions ("count by 3 from 5: 5 8 11 ...").
"""

from __future__ import annotations

import random

# (singular, plural) pairs; irregular plurals are part of what there is to learn.
_NOUNS = (
    ("cat", "cats"),
    ("dog", "dogs"),
    ("owl", "owls"),
    ("fox", "foxes"),
    ("mouse", "mice"),
    ("goat", "goats"),
    ("eagle", "eagles"),
    ("sheep", "sheep"),
)
# (third person singular, plural) verb forms.
_VERBS = (
    ("sees", "see"),
    ("likes", "like"),
    ("chases", "chase"),
    ("follows", "follow"),
    ("helps", "help"),
    ("watches", "watch"),
)
_ADJECTIVES = ("small", "big", "red", "old", "quick", "happy", "angry", "sleepy")
_PLURAL_DETERMINERS = ("the", "two", "three", "some", "many")
_NAMES = ("ada", "bo", "cyd", "dax", "eli", "fay", "gus", "ivo", "jun", "kit")
_TOWNS = ("oslo", "lima", "rome", "kyiv", "baku", "doha", "riga", "bern")
_PETS = ("cat", "dog", "owl", "fox", "goat", "none")


def _noun_phrase(rng: random.Random, plural: bool) -> str:
    noun = rng.choice(_NOUNS)[plural]
    words = [rng.choice(_ADJECTIVES), noun] if rng.random() < 0.5 else [noun]
    if plural:
        determiner = rng.choice(_PLURAL_DETERMINERS)
    elif rng.random() < 0.5:
        determiner = "the"
    else:
        determiner = "an" if words[0][0] in "aeiou" else "a"
    return " ".join([determiner, *words])


def _story(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(rng.randint(3, 5)):
        plural = rng.random() < 0.5
        subject = _noun_phrase(rng, plural)
        verb = rng.choice(_VERBS)[0 if not plural else 1]
        sentence = f"{subject} {verb} {_noun_phrase(rng, rng.random() < 0.5)}."
        lines.append(sentence[0].upper() + sentence[1:])
    return lines


def _arithmetic(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(rng.randint(4, 7)):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        op = rng.choice("+-*")
        if op == "-" and a < b:
            a, b = b, a
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"{a} {op} {b} = {result}")
    return lines


def _records(rng: random.Random) -> list[str]:
    first_id = rng.randint(1, 90)
    lines = []
    for offset in range(rng.randint(3, 5)):
        index = rng.randrange(len(_NAMES))
        town = _TOWNS[index % len(_TOWNS)]
        pet = rng.choice(_PETS)
        age = rng.randint(20, 69)
        lines.append(
            f"id: {first_id + offset}; name: {_NAMES[index]}; town: {town}; pet: {pet}; age: {age}"
        )
    return lines


def _counting(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(rng.randint(2, 3)):
        step, start = rng.randint(1, 5), rng.randint(0, 20)
        terms = " ".join(str(start + step * i) for i in range(rng.randint(5, 8)))
        lines.append(f"count by {step} from {start}: {terms}")
    return lines


_GENERATORS = {
    "story": _story,
    "arithmetic": _arithmetic,
    "records": _records,
    "counting": _counting,
}
_KINDS = tuple(_GENERATORS)


def default_corpus(num_docs: int = 4000, seed: int = 0) -> list[str]:
    """Return ``num_docs`` synthetic documents, the same ones for the same ``seed``."""
    if num_docs < 1:
        raise ValueError(f"num_docs must be at least 1, got {num_docs}")
    rng = random.Random(seed)
    return ["\n".join(_GENERATORS[rng.choice(_KINDS)](rng)) for _ in range(num_docs)]


def default_corpus_info(num_docs: int = 4000, seed: int = 0) -> str:
    """One line describing ``default_corpus(num_docs, seed)``, with its size."""
    size = sum(len(doc.encode("utf-8")) for doc in default_corpus(num_docs, seed))
    return (
        f"synthetic grammar corpus: {num_docs} documents, {size / 1000:.0f} kB, seed {seed} "
        f"({', '.join(_KINDS)})"
    )
