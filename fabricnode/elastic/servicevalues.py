"""The service file's values, one check per kind: each normalises a value or raises ``Bad``.

An integer in a range, a duration (to whole milliseconds), a Slurm time limit (to seconds), a
text, a word, a list of them without repeats, the GPU types (to catalog names), the GPUs per
replica (``"auto"``: None), the engine (the shorthands to their templates, every template to
single spaces) and the sbatch options the file may pass. ``field_checks`` maps each
``[[model]]`` key to its check; ``servicecheck.Checker`` says where a ``Bad`` was found.

Pure in what it does; its imports are not: a time limit is read by ``host.slurm``'s parser and
an engine template checked by ``engine.template``'s, which sit beside Slurm's probes and the
engine's port checks. So this module and ``servicecheck`` stay outside the ``elastic-pure``
contract, and nothing in that contract imports them (``vocab`` takes the records from
``servicespec``).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import string
from collections.abc import Callable, Mapping
from typing import Any

from scheduler.catalog import Catalog
from scheduler.errors import CatalogError

from fabricnode.elastic.servicespec import (
    AUTO,
    ENGINE_SHORTHANDS,
    MAX_ENGINE,
    MAX_HOLD_MS,
    MAX_IDLE_MS,
    MAX_LIST,
    MAX_REPLICAS,
    MAX_SCALE_IN_HOLD_MS,
    MAX_SLEEP_AFTER_MS,
    MAX_TEXT,
    MAX_TIME_LIMIT_S,
    MAX_TTFT_MS,
    MIN_TIME_LIMIT_S,
    SIM,
    format_duration,
    join_command,
)
from fabricnode.engine.template import template_words
from fabricnode.errors import ConfigError
from fabricnode.host.slurm import parse_time_limit
from fabricnode.mesh.assignment import MAX_MODEL_ID, MAX_PARALLEL
from fabricnode.mesh.sites import site_problem

# sbatch options the file may not pass in sbatch_args: the ones with a key of their own, and
# the ones the controller must own to find, size, tag and replace its jobs. Value: what to use.
_OWNED_SBATCH: Mapping[str, str] = {
    "partition": "the partitions key",
    "time": "the time_limit key",
    "account": "the account key",
    "qos": "the qos key",
    "gres": "gpus_per_replica (and gpu_types)",
    "gpus": "gpus_per_replica (and gpu_types)",
    "gpus-per-node": "gpus_per_replica (and gpu_types)",
    "gpus-per-task": "gpus_per_replica (and gpu_types)",
    "nodes": "nothing: a replica is one job on one node",
    "array": "nothing: the controller submits one job per replica",
    "job-name": "nothing: the controller names its jobs",
    "comment": "nothing: the controller tags its jobs with it, to count them",
    "export": "nothing: the controller sets the job's environment",
    "export-file": "nothing: the controller sets the job's environment",
    "signal": "nothing: the controller sets the warning before the time limit",
    "clusters": "nothing: the controller lists its jobs on this cluster",
    "wait": "nothing: the controller must not wait for the job to end",
    "test-only": "nothing: the controller submits the job",
    "parsable": "nothing: the controller adds it",
    "wrap": "nothing: the job runs the fabric-serve wrapper",
}
# sbatch's short options (getopt's), by whether they take a value, and the long option each
# owned one stands for. A cluster such as ``-vp gpu`` is ``-v -p gpu``, as getopt reads it.
_SHORT_SBATCH = {"p": "partition", "t": "time", "A": "account", "q": "qos", "G": "gpus"}
_SHORT_SBATCH |= {"N": "nodes", "a": "array", "J": "job-name", "M": "clusters", "W": "wait"}
_SHORT_WITH_VALUE = frozenset("AaBbCcDdeFGiJLMmNnopqStwx")
_SHORT_FLAGS = frozenset("HhkOQsuVvW")


def _owned_long(name: str) -> str | None:
    """The owned option a long name stands for, by getopt_long's rule (sbatch parses with
    it): the exact name, or any prefix of it, since getopt takes an unambiguous prefix for
    the option (``--ar=`` is ``--array``, ``--qo=`` is ``--qos``); a prefix that several
    options share is refused here too, as sbatch refuses it as ambiguous. None: not owned."""
    if name in _OWNED_SBATCH:
        return name
    return next((o for o in _OWNED_SBATCH if o.startswith(name)), None) if name else None


class Bad(Exception):
    """A value that does not check; ``index`` is the list entry at fault, if one is."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.index = index


def show(value: object) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, dict):
        text = "a table"
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def kind(value: object) -> str:
    for types, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (dict, "a table"),
    ):
        if isinstance(value, types):
            return name
    return "a date or time"


def integer(low: int, high: int) -> Callable[[object], int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            hint = " (without quotes)" if isinstance(value, str) and value.isdigit() else ""
            raise Bad(f"expected an integer{hint}, got {show(value)}")
        if not low <= value <= high:
            raise Bad(f"expected {low}..{high}, got {value}")
        return value

    return check


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)")
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?\s*(?:ms|s|m|h)\s*)+")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def _duration_ms(allow_zero: bool, high_ms: int) -> Callable[[object], int]:
    """Whole milliseconds of ``"500ms"``, ``"2s"``, ``"1m30s"``, ``"1h"`` or a number of
    seconds."""
    expected = 'a duration like "500ms", "2s", "10m", "1h30m" or a number of seconds'

    def check(value: object) -> int:
        if isinstance(value, bool):
            raise Bad(f"expected {expected}, got {show(value)}")
        if isinstance(value, int | float):
            exact = float(value) * 1000
        elif isinstance(value, str) and _DURATION.fullmatch(value.strip()):
            parts = _DURATION_PART.findall(value)
            exact = sum(float(number) * _UNIT_MS[unit] for number, unit in parts)
        else:
            raise Bad(f"expected {expected}, got {show(value)}")
        if math.isnan(exact):
            raise Bad(f"expected {expected}, got {show(value)}")
        if exact > high_ms:  # inf too
            raise Bad(f"at most {format_duration(high_ms / 1000)}, got {show(value)}")
        ms = round(max(exact, -1.0))
        if ms < 0 or (ms == 0 and not allow_zero):
            raise Bad(f"must be {'0 or more' if allow_zero else 'more than 0'}, got {show(value)}")
        return ms

    return check


def _time_limit(value: object) -> int:
    """Seconds of a Slurm time limit (``"2:00:00"``, ``"1-00:00:00"``) or minutes (int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        seconds = value * 60
    elif isinstance(value, str) and (parsed := parse_time_limit(value)) is not None:
        seconds = parsed
    else:
        unlimited = isinstance(value, str) and value.strip().lower() in ("unlimited", "infinite")
        hint = " (omit time_limit for the partition's default)" if unlimited else ""
        raise Bad(
            "expected a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) or "
            f"minutes as an integer, got {show(value)}{hint}"
        )
    if seconds < MIN_TIME_LIMIT_S:
        raise Bad(f"{show(value)} is under {MIN_TIME_LIMIT_S // 60} minutes")
    if seconds > MAX_TIME_LIMIT_S:
        raise Bad(f"{show(value)} is over {MAX_TIME_LIMIT_S // 86400} days")
    return seconds


def _text(value: object, what: str, limit: int = MAX_TEXT, spaces: bool = True) -> str:
    if not isinstance(value, str):
        raise Bad(f"expected {what} (a string), got {kind(value)}")
    if not value.strip():
        raise Bad(f"expected {what}, got an empty string")
    if len(value) > limit:
        raise Bad(f"{what} longer than {limit} characters")
    if not value.isprintable() or (not spaces and any(c.isspace() for c in value)):
        bad = "unprintable characters" if spaces else "spaces or unprintable characters"
        raise Bad(f"{what} {show(value)} contains {bad}")
    return value


def _name(value: object) -> str:
    return _text(value, "a model id", MAX_MODEL_ID, spaces=False)


def _model_path(value: object) -> str:
    return _text(value, "a path")


def _word(what: str, forbidden: str = "") -> Callable[[object], str]:
    def check(value: object) -> str:
        text = _text(value, what, spaces=False)
        bad = sorted({c for c in text if c in forbidden})
        if bad:
            raise Bad(f"{what} {show(text)} contains {' '.join(bad)}")
        return text

    return check


def _list(
    item: Callable[[object], str], what: str, key_of: Callable[[str], str] = str.casefold
) -> Callable[[object], tuple[str, ...]]:
    def check(value: object) -> tuple[str, ...]:
        if not isinstance(value, list):
            single = f" (write [{show(value)}])" if isinstance(value, str) else ""
            raise Bad(f"expected a list of {what}{single}, got {kind(value)}")
        if not value:
            raise Bad("empty list: omit the key instead")
        if len(value) > MAX_LIST:
            raise Bad(f"more than {MAX_LIST} entries")
        items: list[str] = []
        seen: dict[str, int] = {}
        for index, entry in enumerate(value):
            try:
                checked = item(entry)
            except Bad as exc:
                raise Bad(exc.message, index) from None
            first = seen.setdefault(key_of(checked), index)
            if first != index:
                again, before = show(entry), show(value[first])
                twice = "is listed twice" if again == before else f"is the same as {before}"
                raise Bad(f"{again} {twice}", index)
            items.append(checked)
        return tuple(items)

    return check


def _gpu_types(catalog: Catalog) -> Callable[[object], tuple[str, ...]]:
    def gpu(value: object) -> str:
        name = _text(value, "a GPU type")
        try:
            return catalog.gpu(name).name
        except CatalogError:
            known = ", ".join(sorted(catalog.gpus))
            raise Bad(f"unknown GPU type {show(name)} (known: {known}, or an alias)") from None

    return _list(gpu, "GPU types", key_of=lambda name: name)


def _gpus_per_replica(value: object) -> int | None:
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Bad(f'expected an integer 1..{MAX_PARALLEL} or "auto", got {show(value)}')
    if not 1 <= value <= MAX_PARALLEL:
        raise Bad(f'expected 1..{MAX_PARALLEL} or "auto", got {value}')
    return value


def _engine(value: object) -> str:
    what = 'an engine command template, "vllm", "sglang" or "sim"'
    if not isinstance(value, str):
        raise Bad(f"expected {what} (a string), got {kind(value)}")
    text = value.strip()
    if not text:
        raise Bad(f"expected {what}, got an empty string")
    if len(text) > MAX_ENGINE:
        raise Bad(f"longer than {MAX_ENGINE} characters")
    if not all(c.isprintable() or c in "\t\n\r" for c in text):
        raise Bad("contains unprintable characters")
    if text == SIM:
        return SIM
    text = ENGINE_SHORTHANDS.get(text, text)
    try:
        return join_command(template_words(text))
    except ConfigError as exc:
        raise Bad(str(exc)) from None


def placeholders(engine: str) -> set[str]:
    if engine == SIM:
        return set()
    return {
        name
        for word in shlex.split(engine)
        for _, name, _, _ in string.Formatter().parse(word)
        if name is not None
    }


def _sbatch_args(value: object) -> tuple[str, ...]:
    """sbatch options, read as sbatch's getopt reads them; an option the controller owns, by
    any spelling sbatch accepts for it, is refused with what to use instead. A long option's
    value goes after ``=`` (``--constraint=a100``), a short one's may be the next entry
    (``-C a100``): sbatch takes the first word that is no option's value for its script, so a
    word this cannot tell is a value is refused rather than passed on."""
    args = _list(lambda v: _text(v, "an sbatch option"), "sbatch options", key_of=str)(value)
    takes_value = False
    for index, arg in enumerate(args):
        if takes_value:
            takes_value = False
            continue
        if not arg.startswith("-") or arg == "-":
            hint = " (a long option's value goes after =, as in --constraint=a100)"
            after_long = index > 0 and args[index - 1].startswith("--")
            raise Bad(
                f"{show(arg)} is not an sbatch option (they start with -)"
                + (hint if after_long else ""),
                index,
            )
        if arg == "--":
            raise Bad("-- ends sbatch's options: the controller adds the script after them", index)
        if arg.startswith("--"):
            owned = _owned_long(arg[2:].partition("=")[0])
        else:
            owned, takes_value = _owned_short(arg, index)
        if owned is not None:
            raise Bad(f"{arg} is not allowed here: use {_OWNED_SBATCH[owned]}", index)
    if takes_value:
        raise Bad(f"{args[-1]} needs a value", len(args) - 1)
    return args


def _owned_short(arg: str, index: int) -> tuple[str | None, bool]:
    """(the owned option a short cluster names, whether its last option awaits a value)."""
    for i, c in enumerate(arg[1:], start=1):
        if c in _SHORT_SBATCH:
            return _SHORT_SBATCH[c], False
        if c in _SHORT_WITH_VALUE:
            return None, i == len(arg) - 1  # the rest of the cluster is its value
        if c not in _SHORT_FLAGS:
            raise Bad(f"{arg}: -{c} is not an sbatch option", index)
    return None, False


def _site(value: object) -> str:
    if not isinstance(value, str):
        raise Bad(f"expected a site name (a string), got {kind(value)}")
    problem = site_problem(value)
    if problem:
        raise Bad(f"site {show(value)}: {problem}")
    return value


def _sites(value: object) -> tuple[str, ...]:
    """The sites that may serve a model (data residency), sorted: their order means nothing
    (names are compared exactly, so ``A`` and ``a`` are two sites)."""
    return tuple(sorted(_list(_site, "site names", key_of=str)(value)))


def field_checks(catalog: Catalog) -> dict[str, Callable[[object], Any]]:
    """Each ``[[model]]`` key's check (GPU types against ``catalog``)."""
    return {
        "name": _name,
        "engine": _engine,
        "model_path": _model_path,
        "gpu_types": _gpu_types(catalog),
        "gres_types": _list(_word("a Slurm GPU type", ",:"), "Slurm GPU types", key_of=str),
        "gpus_per_replica": _gpus_per_replica,
        "min_replicas": integer(0, MAX_REPLICAS),
        "max_replicas": integer(1, MAX_REPLICAS),
        "ttft_p95": _duration_ms(False, MAX_TTFT_MS),
        "idle_to_zero": _duration_ms(False, MAX_IDLE_MS),
        "hold_requests": _duration_ms(True, MAX_HOLD_MS),
        "partitions": _list(_word("a partition", ","), "partitions", key_of=str),
        "account": _word("an account"),
        "qos": _word("a QOS"),
        "time_limit": _time_limit,
        "sbatch_args": _sbatch_args,
        "sleep_after": _duration_ms(False, MAX_SLEEP_AFTER_MS),
        "scale_in_hold": _duration_ms(True, MAX_SCALE_IN_HOLD_MS),
        "sites": _sites,
        "prefer_sites": _list(_site, "site names", key_of=str),
    }
