"""Hiding the secrets of an engine command line before anyone is shown it.

An engine command can carry secrets in three places, and each is found by the grammar that
reads it, not by a list of flag names:

* **Option values, by the engines' argument grammar.** vLLM and SGLang parse their flags with
  ``argparse``: an option is a token that starts with ``-`` (and is not a negative number);
  ``--name=value`` carries exactly one value; ``--name value ...`` takes the tokens up to the
  next option, as many as the option's ``nargs`` allows, and some secret options take several
  (vLLM's ``--api-key K1 K2`` accepts every key listed). So every token after an option whose
  name says it is secret (``secret_name``: a word of it, split at ``-``, ``_``, ``.`` and
  camelCase, is one of ``SECRET_WORDS``, so ``--hf-token`` and ``apiKey`` are secret and
  ``--max-num-batched-tokens`` and ``--tokenizer`` are not) is hidden, up to the next
  option: whatever ``nargs`` the option has, those are its values or the positionals argparse
  would also have taken into it.
* **Inside structured values.** Options such as ``--kv-transfer-config``, ``--hf-overrides`` or
  ``--speculative-config`` take JSON: a value that parses as a JSON object or array has every
  member whose key says it is secret hidden, at any depth, and is shown re-encoded. A value
  that is not JSON (a Python literal, ``KEY=VALUE``) has each ``name: value`` or ``name=value``
  pair whose name says it is secret hidden.
* **In URLs.** A URL's user information (``https://user:password@host``, or a token as the user
  name) is hidden whole, wherever a URL appears.

Hiding too much costs a reader a value; hiding too little leaks a credential to everyone who may
open the dashboard. Pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

HIDDEN = "***"
SECRET_WORDS = frozenset(
    (
        "key",
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "passphrase",
        "pwd",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "cookie",
        "signature",
    )
)
WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d*)?([eE][-+]?\d+)?\Z|-\.\d+\Z")
# scheme://userinfo@ : the userinfo (a user, a user:password, or a bare token) is hidden whole.
URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@\s]+)@")
# name: value or name=value pairs inside a value that is not JSON, quoted or not.
PAIR = re.compile(
    r"""(?P<name>["']?[A-Za-z0-9_.-]+["']?)(?P<sep>\s*[:=]\s*)"""
    r"""(?P<value>"[^"]*"|'[^']*'|[^\s,;}\]]+)"""
)


def redact(argv: Sequence[str]) -> list[str]:
    """``argv`` with every secret value hidden (module docstring)."""
    out: list[str] = []
    secret_values = False  # the tokens now read are values of a secret option
    for arg in argv:
        if is_option(arg):
            name, eq, value = arg.partition("=")
            secret = secret_name(name)
            if eq:
                out.append(f"{name}={HIDDEN if secret else hide_in_value(value)}")
                secret_values = False  # --name=value carries its one value
            else:
                out.append(arg)
                secret_values = secret
            continue
        out.append(HIDDEN if secret_values else hide_in_value(arg))
    return out


def secret_name(name: str) -> bool:
    """Whether an option, JSON key or variable name says its value is secret."""
    return any(w.lower() in SECRET_WORDS for w in WORD.findall(name))


def is_option(arg: str) -> bool:
    """What argparse takes for an option: ``-x``, ``--name``, not ``-``, ``--`` or ``-1.5``."""
    return len(arg) > 1 and arg.startswith("-") and arg != "--" and not NEGATIVE_NUMBER.match(arg)


def hide_in_value(value: str) -> str:
    """One value with the secrets inside it hidden: JSON members, ``name=value`` pairs, URLs."""
    stripped = value.strip()
    if stripped[:1] in ("{", "["):
        try:
            doc = json.loads(stripped)
        except ValueError:
            pass
        else:
            return json.dumps(_hide_in_json(doc), separators=(",", ":"))
    value = URL_USERINFO.sub(lambda m: f"{m['scheme']}{HIDDEN}@", value)
    return PAIR.sub(_hide_pair, value)


def _hide_pair(m: re.Match[str]) -> str:
    name = m["name"]
    if not secret_name(name):
        return m[0]
    quote = m["value"][0] if m["value"][:1] in ("'", '"') else ""
    return f"{name}{m['sep']}{quote}{HIDDEN}{quote}"


def _hide_in_json(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {
            k: HIDDEN if isinstance(k, str) and secret_name(k) else _hide_in_json(v)
            for k, v in doc.items()
        }
    if isinstance(doc, list):
        return [_hide_in_json(v) for v in doc]
    if isinstance(doc, str):
        return hide_in_value(doc)
    return doc
