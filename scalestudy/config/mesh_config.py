"""The device mesh's configuration: one section of `config.ExperimentConfig`
(train/sharding.py builds the mesh from it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from scalestudy.config.base import Frozen
from scalestudy.config.errors import ConfigError


class MeshConfig(Frozen):
    """Device mesh shape; one axis may be -1 for 'all remaining devices'."""

    data: int = -1
    fsdp: int = 1
    # Expert parallelism: routed experts split over this axis (it also splits the batch, like
    # data). Left out of dumps while 1.
    expert: int = Field(1, exclude_if=lambda v: v == 1)
    tensor: int = 1
    # A group's member axis (train/members.py): "none" keeps every member on every device
    # group (each member's rows split over the batch axes, as a run's are); "data" splits the
    # members over the data axis, so that each data slice trains whole members (the group's
    # size a multiple of the data axis's). A run alone has no member axis and ignores it.
    # Left out of dumps while "none".
    members: Literal["none", "data"] = Field("none", exclude_if=lambda v: v == "none")
    # How a group's program runs its members (train/program.py): "vmap" batches them
    # (every operation K members wide: what pays where small steps are launch-bound, and what
    # splitting them over a mesh axis needs); "loop" runs their steps one after another inside
    # the one compiled program (one compile and one dispatch for K, each member's step the
    # run's own: on a CPU, where these steps are memory-bound and K-wide arrays outgrow the
    # cache, the cheaper); "auto" loops on CPU with whole members, else vmaps. Left out of
    # dumps while "auto".
    member_program: Literal["auto", "vmap", "loop"] = Field(
        "auto", exclude_if=lambda v: v == "auto"
    )

    @property
    def shape(self) -> dict[str, int]:
        """The mesh axes and their sizes ("expert" only where it is not 1)."""
        expert = {} if self.expert == 1 else {"expert": self.expert}
        return {"data": self.data, "fsdp": self.fsdp, **expert, "tensor": self.tensor}

    @model_validator(mode="after")
    def _check(self) -> MeshConfig:
        bad = {k: v for k, v in self.shape.items() if v == 0 or v < -1}
        if bad:
            raise ConfigError(
                f"mesh sizes must be positive or -1 ('the rest'); got {bad}; full mesh {self.shape}"
            )
        if sum(v == -1 for v in self.shape.values()) > 1:
            raise ConfigError(
                f"at most one mesh axis may be -1; got {self.shape}. Give the others explicit sizes"
            )
        if self.member_program == "loop" and self.members != "none":
            raise ConfigError(
                f"mesh.member_program='loop' runs whole members one after another and cannot "
                f"split them over a mesh axis (mesh.members={self.members!r}); use "
                "member_program 'vmap' or 'auto', or mesh.members 'none'"
            )
        return self
