"""The clustering's outputs, routed to the detectors that read them (stage route).

grid.detectors is one list, and DVC gives every stage of a matrix the same dependencies: the
train and evaluate stages of all detectors cannot name the clustering for HaMI (SP) and the
semantic-entropy probes alone, and naming it for all of them would retrain every detector on a
cluster setting. So the route stage of a cell writes one directory per family and detector,
data/routed/<model>/<dataset>/<family>/<detector>/, and each train or evaluate stage depends on
its own:

- a detector that reads the clustering gets a copy of the files its family reads (a row per answer:
  clusters.parquet is 50 KB on the demo world), and its stage reads them there;
- a score with nothing to train (methods/scores.py) gets a copy of the generations in its train
  directory (what it is computed from), and one that asks the model again (p_true) the questions and
  the model preset too: a preset edit (a device_map, say) re-runs it alone, not every detector;
- any other detector gets only the manifest, whose bytes never change with the clustering, so
  DVC skips its stage when the clustering changes.

Each directory holds `reads.json` (the detector's name and the files routed to it), so a stage
checks it was handed its own directory before it reads anything.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from halludetect.core.atomic_io import atomic_path
from halludetect.core.errors import DataError
from halludetect.methods import CLUSTER_METHODS, SCORES

# What each family's stage reads of the clustering, by the key the stage's arguments use.
FAMILIES: dict[str, tuple[str, ...]] = {
    "train": ("clusters",),  # P_sem (HaMI (SP), the P_sem score), the entropy (the SE probes' target), the sets
    "evaluate": ("clusters", "timings", "latency", "cluster_metrics"),  # + their cost, HaMI (SP)'s bundle
}
MODEL = "model_preset"  # the model preset (written from params.yaml), to a score that asks the model again
FILES = {
    "clusters": "clusters.parquet",
    "timings": "cluster_timings.parquet",
    "latency": "latency.json",
    "cluster_metrics": "cluster_metrics.json",
    "generations": "generations.parquet",  # to every score's train stage
    "questions": "questions.parquet",  # to p_true's: its prompt
    MODEL: "model_preset.json",
}
MANIFEST = "reads.json"


def reads_clustering(name: str) -> bool:
    return name in CLUSTER_METHODS or (name in SCORES and SCORES[name].reads_clusters)


def routed_keys(name: str, family: str) -> tuple[str, ...]:
    """What the route stage hands `name`'s stage of `family`, by the key of its arguments."""
    keys = FAMILIES[family] if reads_clustering(name) else ()
    if family == "train" and name in SCORES:
        keys += ("generations",) + (("questions", MODEL) if SCORES[name].source == "model" else ())
    return keys


def write_routes(
    detectors: list[str], sources: dict[str, str | Path], out: str | Path, model: dict | None = None
) -> dict[str, int]:
    """Write `out` (atomically, as a whole): <family>/<detector>/ for every detector of the list,
    copies of `sources` ({key: file}) and `model` (the cell's model preset, as params.yaml holds it)
    where `routed_keys` says. Returns how many detectors read the clustering, and how many not."""
    if missing := [f"{key} ({path})" for key, path in sources.items() if not Path(path).is_file()]:
        raise DataError(f"route: missing {', '.join(missing)}: run the stages that write them first")
    readers = [name for name in detectors if reads_clustering(name)]
    with atomic_path(out, is_dir=True) as tmp:
        for family in FAMILIES:
            for name in detectors:
                here = tmp / family / name
                here.mkdir(parents=True)
                reads = {key: FILES[key] for key in routed_keys(name, family)}
                for key, file in reads.items():
                    if key == MODEL:
                        if model is None:
                            raise DataError(f"route: {name} asks the model again: pass the model preset")
                        (here / file).write_text(json.dumps(model, indent=2, sort_keys=True) + "\n")
                    else:
                        shutil.copyfile(sources[key], here / file)
                manifest = {"detector": name, "reads": reads}
                (here / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {"read_the_clustering": len(readers), "not": len(detectors) - len(readers)}


def routed_inputs(directory: str | Path, method: str, family: str) -> dict[str, str | None]:
    """The clustering files a `family` stage of `method` reads ({key: path}, None where it reads
    none), from the directory the route stage wrote for it."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        name, reads = manifest["detector"], manifest["reads"]
    except FileNotFoundError:
        raise DataError(f"{path} is missing: the route stage writes it (dvc repro route@<model>-<dataset>)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not the route stage's manifest ({e}); re-run route") from None
    if name != method:
        raise DataError(f"{path} routes the clustering to {name!r}, not {method!r}: pass {method}'s own directory")
    keys = routed_keys(method, family)
    if set(reads) != set(keys):
        raise DataError(
            f"{path}: the route stage handed {method}'s {family} stage {sorted(reads) or 'nothing'}, not "
            f"{sorted(keys) or 'nothing'}: re-run route (its code or grid.detectors changed since)"
        )
    return {key: str(Path(directory) / reads[key]) if key in reads else None for key in (*FAMILIES[family], *keys)}


def take_routed(args, family: str) -> None:
    """Set a stage's clustering arguments (`args.clusters`, ...: FAMILIES[family]) from its `--routed`
    directory, where given; passing both is refused."""
    if not args.routed:
        return
    routed = routed_inputs(args.routed, args.method, family)
    if given := [key for key in routed if getattr(args, key, None)]:
        raise DataError(f"pass --routed or --{', --'.join(k.replace('_', '-') for k in given)}, not both")
    for key, path in routed.items():
        setattr(args, key, path)
