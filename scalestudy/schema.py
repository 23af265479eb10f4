"""The base of every config model: frozen, typed, strict, and no unknown keys."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

Tuple = Annotated[tuple, Field(strict=False)]  # YAML gives lists; accept them for tuples.


class Frozen(BaseModel):
    """A frozen pydantic model that refuses unknown keys, loose types and inf/nan."""

    # allow_inf_nan=False: `.inf` or `.nan` for a float (eps, grad_clip_norm, z_loss, ...) is
    # an error naming the key, not a run whose parameters never change.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    def replace(self, **changes: Any) -> Frozen:
        """A validated copy with `changes` applied (nested models may be given as dicts)."""
        return type(self).model_validate({**self.model_dump(), **changes})
