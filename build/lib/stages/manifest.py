"""Resolve a model preset into a manifest: what exactly will be loaded.

For a local directory the manifest holds the sha256 of every file; for a hub id, the
resolved commit. Downstream stages depend on the manifest, so they re-run when the model
really changes and not otherwise.
"""

from halludetect.core.atomic_io import write_json
from halludetect.lm.hf_models import is_local, load_config, n_layers
from halludetect.lm.model_manifest import dir_fingerprint, resolve_hub_revision
from stages import common


def run(args, params):
    preset = params.model(args.name)
    config = load_config(preset)  # fails early, with a clear message, if it cannot be found
    manifest = {
        "name": args.name,
        "preset": preset.model_dump(),
        "num_hidden_layers": n_layers(config),
        "hidden_size": config.get_text_config().hidden_size,
    }
    if is_local(preset):
        manifest["files"] = dir_fingerprint(preset.path)
    else:
        manifest["resolved_revision"] = resolve_hub_revision(preset)
    write_json(args.out, manifest)


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--name", required=True, help="model preset name (params: models.<name>)")
    p.add_argument("--out", required=True, help="manifest JSON")
    common.main(run, p)
