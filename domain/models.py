"""A registered model as eligibility sees it, and its memory floors."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class RegisteredModel:
    slug: str
    kind: str = "llm"
    #: Eligibility floor on a device's free VRAM.
    vram_min_mb: int = 0
    #: Ranking target only; never an eligibility test.
    vram_preferred_mb: int | None = None
    #: Measured floor when run from system memory; None when never measured.
    ram_min_mb: int | None = None
    requires_accelerators: tuple[str, ...] = ()
    reference_throughput: float | None = None
    load_seconds: float | None = None
    updated_at: datetime | None = None

    @property
    def ram_floor_mb(self) -> int:
        """RAM needed when the model runs from system memory.

        Without a measured RAM floor the VRAM floor stands in: the weights do
        not shrink because they moved from VRAM to RAM, and guessing lower
        starts jobs that then swap. A floor of 0 is not a measurement either
        (as for a job's own ``ram_min_mb``): a model with weights of some size
        does not run in no memory.
        """
        return self.ram_min_mb or self.vram_min_mb
