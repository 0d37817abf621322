"""The base class of every params section and the field types they share.

A section rejects unknown keys (a typo must never fall back to a default) and is frozen (a
stage cannot change what it was given). `config.py` composes the sections into `Params`;
a detector method declares its own section in its file under `methods/`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, field_validator


class Section(BaseModel):
    # hide_input_in_errors: pydantic's own message (a section built in Python, outside
    # load_params) would print a refused value, and that value may be a key pasted where its
    # variable's name belongs. `config.format_errors` says what it shows itself.
    # allow_inf_nan=False: `.inf` and `.nan` are no learning rate, fraction or threshold.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, hide_input_in_errors=True, allow_inf_nan=False)

    @field_validator("*", mode="wrap")
    @classmethod
    def _no_bool_as_number(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Lax mode reads `lr: true` as 1.0 and `seeds: [true, false]` as [1, 0]: a yes/no where a
        number is meant is refused instead (everything else stays lax: `lr: 1` is 1.0)."""
        out = handler(value)
        if _bool_became_number(value, out):
            raise ValueError("true or false where a number is meant: write the number")
        return out


def _bool_became_number(raw: Any, out: Any) -> bool:
    """Whether validation turned a bool of `raw` into a number of `out`, anywhere inside lists and dicts."""
    if isinstance(raw, bool):
        return isinstance(out, int | float) and not isinstance(out, bool)
    if isinstance(raw, list | tuple) and isinstance(out, list | tuple) and len(raw) == len(out):
        return any(_bool_became_number(r, o) for r, o in zip(raw, out))
    if isinstance(raw, dict) and isinstance(out, dict):
        return any(_bool_became_number(v, out[k]) for k, v in raw.items() if k in out)
    return False


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
