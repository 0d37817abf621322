"""The world's second dataset (halludetect/world/lookalike.py): each best-known person and one
look-alike, a name one letter from theirs that no world person has, whose facts differ from the
known person's; deterministic for its seed, and built from the questions alone."""

from halludetect.world.kb import build_people, qa_rows
from halludetect.world.lookalike import lookalike_rows


def world_rows():
    return qa_rows(build_people(60, [0, 3, 30], ["birth_city", "job", "instrument"], seed=0))


def test_lookalikes_are_one_letter_from_a_known_person_with_other_facts():
    world = world_rows()
    rows = lookalike_rows(world, seed=0)
    names = {r["entity"] for r in world}
    known = {(r["entity"], r["relation"]): r["answers"][0] for r in world if r["exposure"] == 30}
    assert sorted(r["question"] for r in rows if r["kind"] == "known") == sorted(
        r["question"] for r in world if r["exposure"] == 30
    )
    twins = [r for r in rows if r["kind"] == "lookalike"]
    assert len(twins) == len(known)
    for r in twins:
        twin, of = r["entity"], r["lookalike_of"]
        assert twin not in names and len(twin) == len(of)
        assert sum(a != b for a, b in zip(twin, of)) == 1 and twin.split()[0][0] == of.split()[0][0]
        assert r["answers"][0] != known[(of, r["relation"])] and r["exposure"] == 0
    assert len({r["id"] for r in rows}) == len(rows)


def test_lookalikes_are_deterministic_for_their_seed():
    world = world_rows()
    assert lookalike_rows(world, seed=0) == lookalike_rows(world, seed=0)
    assert lookalike_rows(world, seed=0) != lookalike_rows(world, seed=1)
