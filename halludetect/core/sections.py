"""The base class of every params section and the field types they share.

A section rejects unknown keys (a typo must never fall back to a default) and is frozen (a
stage cannot change what it was given). `config.py` composes the sections into `Params`;
a detector method declares its own section in its file under `methods/`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class Section(BaseModel):
    # hide_input_in_errors: pydantic's own message (a section built in Python, outside
    # load_params) would print a refused value, and that value may be a key pasted where its
    # variable's name belongs. `config.format_errors` says what it shows itself.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, hide_input_in_errors=True)


PositiveInt = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
LearningRate = Annotated[float, Field(gt=0)]
DropoutRate = Annotated[float, Field(ge=0, lt=1)]  # 1 would zero every feature
Decay = Annotated[float, Field(ge=0)]
# Which P_sem of clusters.parquet: sum (the paper's formula: each answer's likelihood P(A|q), the
# product of its token probabilities), mean (length-normalised: exp(mean token log-prob)) or count
# (cluster size / K, the HaMI code's).
PSemVariant = Literal["sum", "mean", "count"]
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _device(value: str) -> str:
    """A torch device a stage can place a model on, checked before anything loads."""
    if not DEVICE.fullmatch(value):
        raise ValueError(f"'{value}' is not a device; use auto, cpu, cuda, cuda:N (a GPU index) or mps")
    return value


Device = Annotated[str, AfterValidator(_device)]
