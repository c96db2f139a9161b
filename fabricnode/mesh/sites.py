"""Sites: the name of the cluster network a node belongs to, and how an entry carries it.

A site is a cluster network (docs/architecture.md, "Sites"): every agent belongs to exactly
one, named when it starts (``fabric start --site NAME``, else the Slurm cluster it runs in,
else ``DEFAULT_SITE``). The name is part of what the owner signs: ``registry.EntryBody.site``.

On the wire the site rides as one label, ``SITE_LABEL``, appended to the entry's labels, and
only when it is not ``DEFAULT_SITE``: an entry of a single-site mesh is byte for byte what it
was before sites existed, and agents that predate sites carry (and show) an entry of another
site unchanged, as they do any label. Decoding moves the label out of the labels into
``EntryBody.site``; an entry without it (every entry signed before sites existed) is of
``DEFAULT_SITE``. The label is the codec's, not a label like the others: ``fabric start
--label`` refuses its key, and ``EntryBody.sign`` refuses a body whose labels hold it.

A site name is a short token: 1 to ``MAX_SITE_CHARS`` ASCII letters, digits, ``-`` and
``_``, beginning and ending with a letter or a digit (a DNS label's rules, plus the
underscore Slurm cluster names may hold). Names are compared exactly: ``A`` and ``a`` are two
sites. Peers refuse an entry whose site label breaks these rules (``site_problem``), like
any other malformed field.

Pure: no I/O, no clock.
"""

from __future__ import annotations

DEFAULT_SITE = "default"
SITE_LABEL = "fabric.site"
MAX_SITE_CHARS = 32

_INNER = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_EDGE = _INNER - {"-", "_"}


def site_problem(name: str) -> str:
    """What is wrong with ``name`` as a site name, ``""`` if nothing (the rules above)."""
    if not name:
        return "a site name cannot be empty"
    if len(name) > MAX_SITE_CHARS:
        return f"a site name has at most {MAX_SITE_CHARS} characters"
    if name[0] not in _EDGE or name[-1] not in _EDGE or not set(name) <= _INNER:
        return (
            "a site name is ASCII letters, digits, '-' and '_', beginning and ending with a "
            "letter or a digit"
        )
    return ""


def site_labels(site: str) -> list[list[str]]:
    """The wire labels that carry ``site``: none for ``DEFAULT_SITE``."""
    return [] if site == DEFAULT_SITE else [[SITE_LABEL, site]]


def split_site(labels: list[tuple[str, str]]) -> tuple[str, list[tuple[str, str]]]:
    """``(site, the other labels)`` of an entry's decoded labels; ``ValueError`` (with the
    reason) if the site label is repeated or its value is no site name."""
    found = [value for key, value in labels if key == SITE_LABEL]
    if not found:
        return DEFAULT_SITE, labels
    if len(found) > 1:
        raise ValueError(f"{SITE_LABEL} given {len(found)} times")
    problem = site_problem(found[0])
    if problem:
        raise ValueError(f"{SITE_LABEL} {found[0][:40]!r}: {problem}")
    return found[0], [(key, value) for key, value in labels if key != SITE_LABEL]
