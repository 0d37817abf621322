"""What exactly a model preset loads: the manifest that the stages using a model depend on.

For a local directory the manifest holds the sha256 of every file; for a hub id, the commit the
preset resolves to. Downstream stages depend on the manifest, so they re-run when the model
really changes, and rebuilding the demo world never re-runs sampling for a hub model.
"""

from __future__ import annotations

from pathlib import Path

from halludetect.config import ModelPreset
from halludetect.core.atomic_io import file_sha256
from halludetect.lm.hf_models import hub_hint


def dir_fingerprint(path: str | Path) -> dict[str, str]:
    """sha256 of every file of a local model directory (for the model manifest)."""
    path = Path(path)
    return {str(f.relative_to(path)): file_sha256(f) for f in sorted(p for p in path.rglob("*") if p.is_file())}


def resolve_hub_revision(preset: ModelPreset) -> str:
    """The commit a hub preset resolves to: online from the hub, offline from the HF cache."""
    from huggingface_hub import HfApi, snapshot_download

    try:
        return HfApi().model_info(preset.path, revision=preset.revision).sha
    except Exception as online_error:  # offline or unreachable: try the local cache
        try:
            path = snapshot_download(preset.path, revision=preset.revision, local_files_only=True)
            return Path(path).name
        except Exception:
            raise hub_hint(preset, online_error) from None
