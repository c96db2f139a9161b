"""HOST:PORT address strings (IPv6 hosts in brackets)."""

from __future__ import annotations

from fabricnode.errors import ConfigError

# Hosts that mean "every interface" when a server binds to them: never an address to connect to
# or to advertise. "[::]" and "*" are how engines' --host flags spell them too.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


def split_hostport(text: str, *, default_port: int | None = None) -> tuple[str, int]:
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
    return host, port


def join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
