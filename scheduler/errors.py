"""The exceptions of the placement scheduler, grafted onto fabricnode's one exception tree.

FabricError (fabricnode.errors)
└── SchedulerError          base of everything scheduler/ raises on purpose
    ├── CatalogError        a GPU/model catalog file or entry is missing, unreadable or invalid,
    │                       or a name is not in the catalog (also a ConfigError)
    └── WorkloadError       a workload, inventory or placement is invalid (also a ConfigError)

Both user-facing errors are ConfigErrors too, so the CLI prints them as one clear line.
"""

from __future__ import annotations

from fabricnode.errors import ConfigError, FabricError


class SchedulerError(FabricError):
    """Base class for errors raised on purpose by the scheduler."""


class CatalogError(SchedulerError, ConfigError):
    """A catalog file or entry is invalid, or a GPU type or model is unknown."""


class WorkloadError(SchedulerError, ConfigError):
    """A workload, inventory or placement is invalid."""
