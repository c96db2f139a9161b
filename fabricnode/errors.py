"""The one exception tree of fabricnode.

FabricError                 base of everything the library raises on purpose
├── ConfigError             bad flags, env or files given by a user (one clear line)
├── KeyFileError            a cluster/provider key file is missing, unreadable or malformed
├── AgentApiError           talking to an agent's HTTP API failed (unreachable, or an error answer)
└── WireError               bytes from the network that cannot be accepted
    ├── DecodeError         malformed, oversized or of the wrong type/version
    ├── CryptoError         undecryptable datagram or unknown cluster key id
    └── SignatureError      a record whose signature or self-certifying id does not check

Network-facing code catches WireError at the boundary, counts it and drops the input:
nothing a peer sends propagates into the event loop.
"""


class FabricError(Exception):
    """Base class for errors raised on purpose by fabricnode."""


class ConfigError(FabricError):
    """A user-supplied option, environment variable or file is invalid."""


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
