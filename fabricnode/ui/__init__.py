"""The dashboard's files (``GET /ui``): a static page, its script and stylesheet, and the vendored
charting library, all shipped in the package (``static/``). No build step and nothing fetched
from outside at run time: the page works on a cluster with no internet.

The page is only a view: it reads the same read-only JSON APIs the ``fabric`` CLI reads
(``/fabric/v1/nodes``, ``/models``, ``/stats``, ``/controller``) and, in its playground, sends
chat requests to ``/v1`` like any client, with the API key the user typed. So the files hold no
data and are served to anyone; what they show is guarded by the APIs' own access rules.

Charts: uPlot (MIT, ~50 KB, no dependencies), chosen for its size and speed with streaming
time series; ``make ui-vendor`` refreshes it from npm and records its version, licence and
tarball integrity in ``static/vendor/uplot/VENDORED.json``.

``asset(name)`` serves a file by its name under ``static/`` from a table built once from the
package's files, so no request path is ever joined to a file-system path. ``HEADERS`` are sent
with every file: a strict Content-Security-Policy (scripts, styles and requests only from the
agent itself; no inline script or style, no frames, no forms elsewhere), no MIME sniffing, no
referrer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    "": "text/plain; charset=utf-8",  # LICENSE
}

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)

HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)

INDEX = "index.html"


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str  # a strong validator: the page revalidates (If-None-Match) instead of refetching


def _load() -> dict[str, Asset]:
    table: dict[str, Asset] = {}
    root = resources.files(__package__).joinpath("static")

    def walk(node: Traversable, prefix: str) -> None:
        for child in node.iterdir():
            name = prefix + child.name
            if child.is_dir():
                walk(child, name + "/")
                continue
            suffix = "." + child.name.rsplit(".", 1)[1] if "." in child.name else ""
            content_type = CONTENT_TYPES.get(suffix)
            if content_type is None:
                continue  # not a kind the page uses: not served
            body = child.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
            table[name] = Asset(body, content_type, etag)

    walk(root, "")
    return table


_ASSETS: dict[str, Asset] | None = None


def asset(name: str) -> Asset | None:
    """The file ``name`` (relative to ``static/``; "" is the page), or None."""
    global _ASSETS
    if _ASSETS is None:
        _ASSETS = _load()
    return _ASSETS.get(name or INDEX)


def names() -> list[str]:
    """Every file served, sorted (for tests and docs)."""
    asset(INDEX)
    assert _ASSETS is not None
    return sorted(_ASSETS)
