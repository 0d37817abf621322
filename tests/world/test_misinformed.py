"""The world's third dataset (halludetect/world/misinformed.py): the well-known people's facts, the
reference of a drawn share of them replaced by another value of the relation (the corpus got it
wrong), the rest as the corpus states them; deterministic for its seed, built from the questions."""

import pytest

from halludetect.world.kb import RELATIONS, build_people, qa_rows
from halludetect.world.misinformed import misinformed_rows


def world_rows():
    return qa_rows(build_people(60, [0, 3, 30], ["birth_city", "job", "instrument"], seed=0))


def test_a_share_of_the_known_facts_gets_another_value_as_the_truth():
    world = world_rows()
    rows = misinformed_rows(world, seed=0, min_exposure=30, share=0.5)
    known = [r for r in world if r["exposure"] >= 30]
    assert sorted(r["question"] for r in rows) == sorted(r["question"] for r in known)
    kinds = [r["kind"] for r in rows]
    assert kinds.count("misinformed") == round(0.5 * len(known)) and set(kinds) == {"misinformed", "as_stated"}
    for r in rows:
        truth = r["answers"][0]
        assert r["corpus_answer"] == next(k["answers"][0] for k in known if k["question"] == r["question"])
        assert (truth != r["corpus_answer"]) == (r["kind"] == "misinformed")
        assert truth in RELATIONS[r["relation"]][3]
        assert r["id"].startswith(r["kind"] + "-")
    assert len({r["id"] for r in rows}) == len(rows)


def test_misinformed_facts_are_deterministic_for_their_seed():
    world = world_rows()
    assert misinformed_rows(world, 0, 3, 0.5) == misinformed_rows(world, 0, 3, 0.5)
    assert misinformed_rows(world, 0, 3, 0.5) != misinformed_rows(world, 1, 3, 0.5)


@pytest.mark.hostile
def test_an_exposure_no_person_has_is_named_with_the_highest_one():
    with pytest.raises(
        ValueError, match=r"misinformed.min_exposure 31: no world question has that exposure \(the highest is 30\)"
    ):
        misinformed_rows(world_rows(), 0, 31, 0.5)
