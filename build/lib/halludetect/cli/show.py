"""`halludetect show`: a bundle's summary (`--json`: its metadata)."""

from __future__ import annotations

import json
import sys


def run(args) -> None:
    from halludetect.scoring.bundle import load_bundle, p_sem_requirement
    from halludetect.scoring.bundle_summary import summary_text

    # a damaged bundle is an error here, as when scoring; a plugin's is summarised without its plugin
    b = load_bundle(args.bundle, metadata_only_without_plugin=True)
    for warning in b.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not args.json:
        print(summary_text(b))
        return
    needs = p_sem_requirement(b.meta)  # hami_sp: the P_sem variant and K its input rows must follow
    print(json.dumps({"sha256": b.sha256, **b.meta, **({"needs": needs} if needs else {})}, indent=2, sort_keys=True))


def add(sub) -> None:
    show = sub.add_parser(
        "show",
        help="summarise a bundle: model, layer, training and test figures, thresholds, calibration, input",
        description="Print a readable summary of a detector bundle (--json: its raw metadata).",
    )
    show.add_argument("bundle", help="detector bundle (.safetensors)")
    show.add_argument("--json", action="store_true", help="print the raw metadata as JSON instead (and its sha256)")
    show.set_defaults(run=run)
