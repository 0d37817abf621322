"""The route stage's directories (halludetect/labels/routing.py): the clustering reaches the
detectors that read it, and the directory of any other detector keeps its bytes whatever the
clustering holds, so DVC never re-runs its stages for a cluster change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from halludetect.core.errors import DataError
from halludetect.labels.routing import FAMILIES, FILES, MANIFEST, routed_inputs, write_routes

DETECTORS = ["hami", "max", "hami_sp", "sep_slt"]
READERS = {"hami_sp", "sep_slt"}


def sources(root: Path, tag: str) -> dict[str, Path]:
    """Stand-ins for the cluster and latency stages' files, their bytes marked by `tag`."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, name in FILES.items():
        (root / name).write_text(f"{key} {tag}\n")
        out[key] = root / name
    return out


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_readers_get_copies_and_the_others_a_manifest_the_clustering_never_changes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert write_routes(DETECTORS, sources(tmp_path / "a", "first"), one) == {"read_the_clustering": 2, "not": 2}
    write_routes(DETECTORS, sources(tmp_path / "b", "second"), two)
    for family, keys in FAMILIES.items():
        for name in DETECTORS:
            here = one / family / name
            if name in READERS:
                assert sorted(tree(here)) == sorted([MANIFEST, *(FILES[k] for k in keys)])
                assert tree(here) != tree(two / family / name)  # the new clustering reaches it
                assert (here / FILES["clusters"]).read_text() == "clusters first\n"
            else:
                assert sorted(tree(here)) == [MANIFEST]
                assert tree(here) == tree(two / family / name)  # same bytes: DVC skips its stages
    # train reads clusters.parquet alone: a latency or timing change leaves the readers' training alone
    assert FAMILIES["train"] == ("clusters",)


def test_adding_a_detector_leaves_every_other_directory_as_it_was(tmp_path):
    src = sources(tmp_path / "src", "x")
    write_routes(["max", "hami_sp"], src, tmp_path / "before")
    write_routes(["max", "hami_sp", "hami"], src, tmp_path / "after")
    before, after = tree(tmp_path / "before"), tree(tmp_path / "after")
    assert {k: v for k, v in after.items() if "/hami/" not in k} == before


@pytest.mark.hostile
def test_a_stage_reads_the_files_of_its_own_directory_and_refuses_another(tmp_path):
    out = tmp_path / "routed"
    write_routes(DETECTORS, sources(tmp_path / "src", "x"), out)
    got = routed_inputs(out / "evaluate" / "hami_sp", "hami_sp", "evaluate")
    assert set(got) == set(FAMILIES["evaluate"]) and all(Path(p).is_file() for p in got.values())
    assert routed_inputs(out / "train" / "max", "max", "train") == {"clusters": None}
    with pytest.raises(DataError, match="routes the clustering to 'max', not 'hami_sp'"):
        routed_inputs(out / "train" / "max", "hami_sp", "train")
    # a directory written when the method did not read the clustering (its code changed since)
    stale = out / "train" / "stale"
    stale.mkdir()
    (stale / MANIFEST).write_text(json.dumps({"detector": "hami_sp", "reads": {}}))
    with pytest.raises(DataError, match=r"the route stage handed hami_sp's train stage nothing, not \['clusters'\]"):
        routed_inputs(stale, "hami_sp", "train")


def test_the_scores_get_what_they_are_computed_from_and_p_true_the_model_preset(tmp_path):
    """A score's train stage reads the generations (p_sem the clustering too, p_true the questions and
    the preset, which no other detector gets: a preset edit re-runs p_true alone); its evaluate stage
    the cluster timings where it reads the clustering (its cost)."""
    out, preset = tmp_path / "routed", {"path": "data/world/model", "dtype": "float32"}
    write_routes(["hami", "p_sem", "length", "p_true"], sources(tmp_path / "src", "x"), out, model=preset)
    train = {name: sorted(tree(out / "train" / name)) for name in ("hami", "p_sem", "length", "p_true")}
    assert train == {
        "hami": [MANIFEST],
        "p_sem": sorted([MANIFEST, FILES["clusters"], FILES["generations"]]),
        "length": sorted([MANIFEST, FILES["generations"]]),
        "p_true": sorted([MANIFEST, FILES["generations"], FILES["questions"], FILES["model_preset"]]),
    }
    assert json.loads((out / "train" / "p_true" / FILES["model_preset"]).read_text()) == preset
    assert sorted(tree(out / "evaluate" / "p_sem")) == sorted([MANIFEST, *(FILES[k] for k in FAMILIES["evaluate"])])
    assert sorted(tree(out / "evaluate" / "length")) == sorted(tree(out / "evaluate" / "p_true")) == [MANIFEST]
    got = routed_inputs(out / "train" / "p_true", "p_true", "train")
    assert got["clusters"] is None and all(Path(got[k]).is_file() for k in ("generations", "questions", "model_preset"))
    with pytest.raises(DataError, match="p_true asks the model again: pass the model preset"):
        write_routes(["p_true"], sources(tmp_path / "src", "x"), tmp_path / "none")


@pytest.mark.hostile
def test_a_missing_or_damaged_manifest_says_which_stage_writes_it(tmp_path):
    with pytest.raises(DataError, match=r"reads.json is missing: the route stage writes it"):
        routed_inputs(tmp_path, "max", "train")
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="not the route stage's manifest"):
        routed_inputs(tmp_path, "max", "train")


@pytest.mark.hostile
def test_a_missing_source_fails_before_anything_is_written(tmp_path):
    src = sources(tmp_path / "src", "x")
    src["latency"].unlink()
    with pytest.raises(DataError, match=r"missing latency \(.*latency.json\): run the stages that write them first"):
        write_routes(DETECTORS, src, tmp_path / "routed")
    assert not (tmp_path / "routed").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temporary directory left either


@pytest.mark.hostile
def test_a_stage_takes_its_clustering_arguments_from_its_routed_directory_and_refuses_both(tmp_path):
    from argparse import Namespace

    from halludetect.labels.routing import take_routed

    out = tmp_path / "routed"
    write_routes(DETECTORS, sources(tmp_path / "src", "x"), out)
    args = Namespace(routed=str(out / "train" / "hami_sp"), method="hami_sp", clusters=None)
    take_routed(args, "train")
    assert args.clusters == str(out / "train" / "hami_sp" / FILES["clusters"])
    with pytest.raises(DataError, match="pass --routed or --clusters, not both"):
        take_routed(args, "train")
