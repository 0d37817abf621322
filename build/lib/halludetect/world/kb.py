"""The demo world's knowledge base and training corpus.

A world is a set of fictional people, each with one fact per relation (birth city, job,
instrument). Every person gets an *exposure*: how many times each of their facts appears
in the training corpus (for example 0, 1, 3, 10 or 30 times). A person with exposure 0
never appears at all, so the model meets their name for the first time at question time.

Why this shape: a language model answers prompt 1 about anybody, fluently, but it can only
be right about what it saw often. Facts seen rarely or never give hallucinations, and the
model's hidden states carry the evidence a detector needs: the name is familiar or not, its
tokens were merged by the tokenizer's BPE or not, the fact was retrieved or not.

Everything here is pure Python and deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from halludetect.prompts import generation_prompt

# Syllables for fictional names; capitalised and joined.
_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "kr",
    "pl",
    "st",
    "tr",
    "sh",
    "th",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m"]

CITIES = [
    "Arvella",
    "Brimsford",
    "Calomir",
    "Dunhaven",
    "Eskaroth",
    "Fenwick",
    "Galtura",
    "Harrowgate",
    "Istrana",
    "Jorvik",
    "Kelmora",
    "Lunaris",
    "Maravel",
    "Norhelm",
    "Ostrava",
    "Pellmoor",
    "Quillon",
    "Rasmere",
    "Solvane",
    "Tarwick",
]
JOBS = [
    "baker",
    "pilot",
    "sculptor",
    "surgeon",
    "lawyer",
    "farmer",
    "chemist",
    "tailor",
    "architect",
    "librarian",
    "carpenter",
    "jeweler",
    "astronomer",
    "fisherman",
    "journalist",
    "potter",
    "engineer",
    "florist",
    "dentist",
    "blacksmith",
]
INSTRUMENTS = [
    "violin",
    "cello",
    "flute",
    "harp",
    "trumpet",
    "piano",
    "oboe",
    "banjo",
    "clarinet",
    "drums",
    "guitar",
    "accordion",
    "trombone",
    "harmonica",
    "lute",
    "sitar",
]

# relation -> (question template, answer template, statement templates, value pool)
RELATIONS: dict[str, tuple[str, str, tuple[str, ...], list[str]]] = {
    "birth_city": (
        "Where was {name} born?",
        "{name} was born in {value}.",
        (
            "{name} was born in {value}.",
            "The birthplace of {name} is {value}.",
            "{value} is where {name} was born.",
        ),
        CITIES,
    ),
    "job": (
        "What is the job of {name}?",
        "{name} works as a {value}.",
        (
            "{name} works as a {value}.",
            "By profession, {name} is a {value}.",
            "The job of {name} is {value}.",
        ),
        JOBS,
    ),
    "instrument": (
        "Which instrument does {name} play?",
        "{name} plays the {value}.",
        (
            "{name} plays the {value}.",
            "The instrument of {name} is the {value}.",
            "{name} is known for playing the {value}.",
        ),
        INSTRUMENTS,
    ),
}


@dataclass(frozen=True)
class Person:
    name: str
    exposure: int
    facts: dict[str, str]  # relation -> value


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _name(rng: random.Random) -> str:
    first = "".join(_syllable(rng) for _ in range(2)).capitalize()
    last = "".join(_syllable(rng) for _ in range(rng.choice((2, 3)))).capitalize()
    return f"{first} {last}"


def build_people(n_people: int, exposures: list[int], relations: list[str], seed: int) -> list[Person]:
    """n_people fictional people with unique names, exposures spread evenly over the buckets."""
    unknown = sorted(set(relations) - set(RELATIONS))
    if unknown:
        raise ValueError(f"unknown world relation(s) {unknown}; choose from {sorted(RELATIONS)}")
    rng = random.Random(seed)
    names: set[str] = set()
    people = []
    for i in range(n_people):
        name = _name(rng)
        while name in names:
            name = _name(rng)
        names.add(name)
        facts = {rel: rng.choice(RELATIONS[rel][3]) for rel in relations}
        people.append(Person(name=name, exposure=exposures[i % len(exposures)], facts=facts))
    return people


def question_text(relation: str, name: str) -> str:
    return RELATIONS[relation][0].format(name=name)


def corpus(people: list[Person], qa_fraction: float, seed: int) -> list[str]:
    """Training documents: each fact `exposure` times, as a statement or as a prompt-1 QA pair.

    The QA pairs teach the answer format ("<name> was born in <city>.") in the exact prompt
    the pipeline asks with; the statements are what makes a fact knowledge rather than a
    memorised prompt. Documents are shuffled.
    """
    rng = random.Random(seed)
    docs = []
    for person in people:
        for rel, value in person.facts.items():
            q_tpl, a_tpl, statements, _ = RELATIONS[rel]
            for _ in range(person.exposure):
                if rng.random() < qa_fraction:
                    prompt = generation_prompt(q_tpl.format(name=person.name))
                    docs.append(f"{prompt} {a_tpl.format(name=person.name, value=value)}")
                else:
                    docs.append(rng.choice(statements).format(name=person.name, value=value))
    rng.shuffle(docs)
    return docs


def qa_rows(people: list[Person]) -> list[dict]:
    """The world's questions in the common QA schema (plus the exposure, for world metrics)."""
    rows = []
    for i, person in enumerate(people):
        for rel, value in person.facts.items():
            rows.append(
                {
                    "id": f"world-{i:05d}-{rel}",
                    "question": question_text(rel, person.name),
                    "answers": [value],
                    "context": None,
                    "exposure": person.exposure,
                    "relation": rel,
                    "entity": person.name,
                }
            )
    return rows
