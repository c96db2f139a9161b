"""The one exception tree of fabricnode.

FabricError                 base of everything the library raises on purpose
├── ConfigError             bad flags, env or files given by a user (one clear line)
│   └── ServiceFileError    a service file is invalid: every problem, one line each, with its line
├── KeyFileError            a cluster/provider key file is missing, unreadable or malformed
├── AgentApiError           talking to an agent's HTTP API failed (unreachable, or an error answer)
└── WireError               bytes from the network that cannot be accepted
    ├── DecodeError         malformed, oversized or of the wrong type/version
    ├── CryptoError         undecryptable datagram or unknown cluster key id
    └── SignatureError      a record whose signature or self-certifying id does not check

Network-facing code catches WireError at the boundary, counts it and drops the input:
nothing a peer sends propagates into the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class FabricError(Exception):
    """Base class for errors raised on purpose by fabricnode."""


class ConfigError(FabricError):
    """A user-supplied option, environment variable or file is invalid."""


@dataclass(frozen=True)
class FileProblem:
    """One problem of a file a user wrote: ``line`` counts from 1 (0: the file as a whole),
    ``where`` names the table (``[limits]``, ``[[model]] "llama"``; "" at the top level),
    ``key`` the key ("" for the table itself)."""

    origin: str
    line: int
    where: str
    key: str
    message: str

    def __str__(self) -> str:
        at = f"{self.origin}:{self.line}" if self.line > 0 else self.origin
        label = " ".join(part for part in (self.where, self.key) if part)
        return f"{at}: {label}: {self.message}" if label else f"{at}: {self.message}"


class ServiceFileError(ConfigError):
    """A service file is invalid (``fabricnode.elastic.servicefile``). ``problems`` holds every
    problem found, in line order; the message is one of them, or a count and then one per line
    (``FILE:LINE: where key: what``), so the CLI prints it as it prints any ConfigError."""

    def __init__(self, origin: str, problems: Sequence[FileProblem]) -> None:
        self.origin = origin
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            message = str(self.problems[0])
        else:
            lines = "\n".join(str(problem) for problem in self.problems)
            message = f"{origin}: {len(self.problems)} problems:\n{lines}"
        super().__init__(message)


class KeyFileError(FabricError):
    """A key file is missing, unreadable or malformed."""


class AgentApiError(FabricError):
    """An agent could not be reached, or answered with an error (``status`` is its HTTP status,
    0 when there was no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class WireError(FabricError):
    """Input from the network that must be dropped."""


class DecodeError(WireError):
    """Malformed, oversized or wrongly typed message."""


class CryptoError(WireError):
    """Datagram that cannot be authenticated under any cluster key we hold."""


class SignatureError(WireError):
    """A signed record whose signature or session id does not verify."""
