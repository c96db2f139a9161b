"""HOST:PORT address strings (IPv6 hosts in brackets).

A host is an IP address or a DNS name (RFC 1123: dot-separated labels of 1-63 letters, digits
and hyphens, not starting or ending with a hyphen, 253 characters at most; underscores are let
through, as resolvers do, for cluster node names that use them). Everything else is refused
where it is parsed: a name such as ``a..b`` cannot be encoded for a lookup (Python raises
``UnicodeError``, not ``OSError``), and addresses reach the mesh from peers' packets and
registry entries.
"""

from __future__ import annotations

import ipaddress
import re

from fabricnode.errors import ConfigError

# Hosts that mean "every interface" when a server binds to them: never an address to connect to
# or to advertise. "[::]" and "*" are how engines' --host flags spell them too.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)\Z")


def valid_host(host: str) -> bool:
    """An IP address or a well-formed DNS name (see the module docstring)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    if not host or len(host) > 253:
        return False
    name = host[:-1] if host.endswith(".") else host  # a fully qualified name's root dot
    return all(_LABEL.match(label) for label in name.split("."))


def split_hostport(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT``; ``ConfigError`` naming what is wrong. The host must be
    ``valid_host`` or one of the ``WILDCARD_HOSTS`` (which only a server binds to)."""
    text = text.strip()
    if text.startswith("["):
        host, _sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise ConfigError(f"address {text!r} needs a port (HOST:PORT)")
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"address {text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"address {text!r}: port out of range")
    if host not in WILDCARD_HOSTS and not valid_host(host):
        raise ConfigError(f"address {text!r}: {host!r} is not an IP address or a host name")
    return host, port


def join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
