"""Detectors built from their method's spec (halludetect/methods/), saved and loaded.

Weights are saved as safetensors with the method, d and params as metadata, so a detector
file is self-describing and loads without pickles.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from halludetect.core.artifacts import damaged, load_safetensors, safetensors_metadata
from halludetect.detectors import networks
from halludetect.methods import METHODS, PluginError
from halludetect.methods import method as lookup_method

WHAT = "detector file (safetensors)"
DETECTORS = METHODS  # name -> its Method (halludetect/methods/): params class, traits, build


def build_detector(method: str, d: int, params) -> nn.Module:
    """The untrained network of `method` for states of width d; `params` is its section of
    params.yaml (detectors.<method>). A plugin whose build returns anything but an nn.Module is
    refused here, naming where it was registered."""
    spec = lookup_method(method)
    net = spec.build(networks, d, params)
    if not isinstance(net, nn.Module):
        where = "halludetect/methods/" if spec.origin is None else spec.origin.describe()
        raise PluginError(
            f"detector '{method}' (from {where}): build returned a {type(net).__name__}, not a torch.nn.Module "
            "mapping Bags to one score per answer; fix its build"
        )
    return net


def check_scores(method: str, z, n: int, where: str, *, finite: bool = True) -> None:
    """A plugin network's output `z` on `where` (n bags) must be one score per bag: a float tensor
    (or array) of shape [n], and finite when `finite`. Anything else stops here with one line naming
    the plugin and what it returned: NaN would train every epoch and then fail writing the figures,
    and another shape fail inside torch with torch's message. Cheap (callers check a first batch,
    or scores they already have) and it reads `z` only; the built-in networks, whose shapes and
    numbers are tested, are not checked."""
    spec = lookup_method(method)
    if spec.origin is None:
        return
    if isinstance(z, torch.Tensor):
        z = z.detach().cpu()
        shape, floating = list(z.shape), z.is_floating_point()
    elif isinstance(z, np.ndarray):
        shape, floating = list(z.shape), np.issubdtype(z.dtype, np.floating)
    else:
        shape, floating = None, False
    if shape is None:
        got = f"a {type(z).__name__}"
    elif shape != [n]:
        got = f"a tensor of shape {shape}"
    elif not floating:
        got = f"a tensor of {z.dtype}"
    elif finite and not (ok := np.isfinite(a := _float64(z))).all():
        a = a[~ok]
        got = f"{int(np.isnan(a).sum())} NaN and {int(np.isinf(a).sum())} infinite score(s) of {n}"
    else:
        return
    raise PluginError(
        f"detector '{method}' (from {spec.origin.describe()}): on {where} of {n} bags its network returned "
        f"{got}, not one finite score per bag (a float tensor of shape [{n}]); fix its forward"
    )


def _float64(z) -> np.ndarray:
    return z.double().numpy() if isinstance(z, torch.Tensor) else np.asarray(z, dtype=np.float64)


def origin_meta(method: str) -> dict | None:
    """What a detector file or bundle records of a plugin method's origin (None: built in)."""
    o = lookup_method(method).origin
    return None if o is None else {"factory": o.factory, "via": o.via, "distribution": o.distribution}


def section(detectors, method: str):
    """`method`'s section of the validated params (detectors.<method>), or a did-you-mean error."""
    lookup_method(method)
    return getattr(detectors, method)


def params_for(method: str, params: dict | None = None):
    """The typed params section of `method`, validated from a dict (defaults when None)."""
    return lookup_method(method).params.model_validate(params or {})


def save_detector(path, state_dict: dict, meta: dict) -> None:
    """Weights as safetensors with `meta` (method, d, params, ...) as one JSON metadata entry.

    One sorted entry, not one per key: safetensors writes its metadata map in no fixed
    order, so several keys would give different bytes for the same detector, and DVC would
    take an unchanged detector for a changed one.
    """
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in state_dict.items()}
    save_file(state, str(path), metadata={"detector": json.dumps(meta, sort_keys=True)})


def read_meta(path) -> dict:
    """The metadata saved with a detector (method, d, layer, seed, params, ...); a damaged file
    (garbage, truncated, empty, or without our metadata) is a `DataError` naming it."""
    raw = safetensors_metadata(path, "train", WHAT).get("detector")
    if raw is None:
        raise damaged(path, WHAT, "train", "no 'detector' metadata: not written by halludetect's train stage")
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict) or not {"method", "d", "params"} <= set(meta):
            raise ValueError("metadata lacks method, d or params")
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise damaged(path, WHAT, "train", f"unreadable 'detector' metadata: {e}") from None
    return meta


def trained_params(directory, method: str):
    """The params a directory's detectors were trained with (evaluation must use the same)."""
    lookup_method(method)  # an unknown method fails first, with suggestions
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no trained detectors in {directory}: run train first")
    return params_for(method, read_meta(files[0])["params"])


def check_known(meta: dict, path) -> None:
    """A detector of a plugin this process has not registered: say which plugin, and how to register
    it (a file never makes us import code)."""
    name, origin = meta["method"], meta.get("origin")
    if name in METHODS or origin is None:
        return
    try:
        lookup_method(name)  # an installed entry point registers itself here
    except KeyError:
        raise PluginError(
            f"{path}: its detector '{name}' comes from the plugin factory '{origin['factory']}' "
            f"({origin['via']}), which is not registered here: install its package (an entry point of "
            f"the group halludetect.detectors), or in Python call halludetect.methods.load_factory("
            f"'{name}', '{origin['factory']}') first"
        ) from None


def load_detector(path) -> tuple[nn.Module, dict]:
    """A trained detector from its safetensors file, rebuilt from the metadata saved with it."""
    meta = read_meta(path)
    check_known(meta, path)
    model = build_detector(meta["method"], int(meta["d"]), params_for(meta["method"], meta["params"]))
    try:
        model.load_state_dict(load_safetensors(path, "train", WHAT))
    except RuntimeError as e:  # missing, unexpected or mis-shaped tensors
        raise damaged(
            path,
            WHAT,
            "train",
            f"its tensors do not fit a '{meta['method']}' detector for d={meta['d']}: {str(e).splitlines()[0]}",
        ) from None
    return model.eval(), meta
