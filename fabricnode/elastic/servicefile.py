"""The service file: which models the mesh serves, and how (TOML, one per mesh).

An operator declares once per mesh the models that should be served; ``fabric services apply``
signs the file and spreads it, and the controller keeps each model between its min and max
replicas with Slurm jobs. This module is the file's format: a pure parser and validator
(``parse``; ``load`` is the one function that reads a file), the frozen spec it yields, the
spec's canonical bytes (``ServiceSpec.canonical``: what is signed and digested) and a renderer
back to TOML (``ServiceSpec.to_toml``). docs/services.md is the reference for every key.

Rules
-----
1. All or nothing. ``parse`` returns a complete ``ServiceSpec`` or raises one
   ``ServiceFileError`` listing every problem it found, each with the file, the line of the
   offending key (or table) and the key. A spec is never applied in part.
2. Unknown keys are errors that list the allowed ones: a misspelt ``max_replica`` must not be
   ignored by a controller that spends GPU hours.
3. ``[defaults]`` holds any ``[[model]]`` key but ``name`` and ``model_path``; a model's own
   key wins. A bad default is reported once, at its line in ``[defaults]``.
4. Values are normalised as they are parsed: GPU types to catalog names, durations to whole
   milliseconds, time limits to seconds, the engine shorthands (``vllm``, ``sglang``) to their
   templates and every template to single spaces. The spec, and so its canonical bytes, depend
   on what the file means, not on how it is written: key order, whitespace, comments, GPU
   aliases, ``[defaults]`` versus the same value in every model, the order of the models.
5. The canonical bytes are a fixed-order msgpack array under the domain
   ``fabric/services/v1`` (``fabricnode.mesh.identity.canonical``), the models sorted by name.
   ``from_canonical`` reads them back, checks them like a file and accepts only bytes that are
   canonical, so a spec received from the mesh is the spec that was signed.
6. Pure: no clock, no environment. The only I/O is ``load`` reading the file, and the GPU
   catalog (``scheduler.catalog.builtin_catalog``, package data) unless one is passed in.

Line numbers
------------
tomllib gives none. Once tomllib has accepted a document, ``_Locator`` scans it with a small
TOML tokenizer (it skips strings and comments, follows ``[[model]]`` headers, inline tables and
arrays) and records the first line of every table header, key and array element by its path,
e.g. ``("model", 2, "gpu_types", 1)``. A problem takes the line of the longest recorded prefix
of its path, so a missing key points at its table's header. Syntax errors take the line in
tomllib's message.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import shlex
import string
import tomllib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.catalog import Catalog, builtin_catalog
from scheduler.errors import CatalogError

from fabricnode.engine.template import SIM, EngineTemplate, template_words
from fabricnode.errors import ConfigError, DecodeError, FileProblem, ServiceFileError
from fabricnode.host.slurm import parse_time_limit
from fabricnode.mesh import codec
from fabricnode.mesh.assignment import MAX_MODEL_ID, MAX_PARALLEL
from fabricnode.mesh.identity import canonical

FORMAT_VERSION = 1
DOMAIN = b"fabric/services/v1"

MIN_TIME_LIMIT_S = 120
MAX_TIME_LIMIT_S = 365 * 86400
MAX_MODELS = 256
MAX_LIST = 64  # entries of gpu_types, partitions, sbatch_args
MAX_TEXT = 1024  # characters of a partition, account, qos, model_path, sbatch argument
MAX_ENGINE = 4096  # characters of an engine template
MAX_REPLICAS = 1024
MAX_JOBS = 10_000
MAX_GPUS = 100_000
MAX_CANONICAL_BYTES = 1 << 20

MAX_TTFT_MS = 600_000  # 10 min: a larger objective is a unit mistake ("2000" meant ms)
MAX_IDLE_MS = 7 * 86_400_000
MAX_HOLD_MS = 3_600_000
MAX_SLEEP_AFTER_MS = 7 * 86_400_000

DEFAULT_MIN_REPLICAS = 1
DEFAULT_IDLE_TO_ZERO_MS = 600_000  # 10m
DEFAULT_HOLD_REQUESTS_MS = 180_000  # 3m
AUTO = "auto"

# ``engine = "vllm"`` / ``"sglang"``: the command the researcher wrapper builds for each.
ENGINE_SHORTHANDS: Mapping[str, str] = {
    "vllm": "vllm serve {model_path} --served-model-name {model} --tensor-parallel-size {tp} "
    "--host {host} --port {port}",
    "sglang": "python3 -m sglang.launch_server --model-path {model_path} --served-model-name "
    "{model} --tp-size {tp} --host {host} --port {port}",
}

# sbatch options the file may not pass in sbatch_args: the ones with a key of their own, and
# the ones the controller must own to find, size and replace its jobs. Value: what to use.
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
    "parsable": "nothing: the controller adds it",
    "wrap": "nothing: the job runs the fabric-serve wrapper",
}
_SHORT_SBATCH = {"p": "partition", "t": "time", "A": "account", "q": "qos", "G": "gpus"}
_SHORT_SBATCH |= {"N": "nodes", "a": "array", "J": "job-name"}

TOP_KEYS = ("version", "defaults", "limits", "model")
LIMIT_KEYS = ("max_jobs", "max_gpus")
# The canonical row of a model: these keys in this order...
ROW_KEYS = (
    "name",
    "engine",
    "model_path",
    "gpu_types",
    "gpus_per_replica",
    "min_replicas",
    "max_replicas",
    "ttft_p95",
    "idle_to_zero",
    "hold_requests",
    "partitions",
    "account",
    "qos",
    "time_limit",
    "sbatch_args",
)
# ...then the keys added since, each only up to the last one set: a file that sets none of them
# has the row (and the digest) it always had, and agents that predate them still read it.
ROW_EXTENSIONS = ("sleep_after", "gres_types")
MODEL_KEYS = (*ROW_KEYS[:4], "gres_types", *ROW_KEYS[4:], "sleep_after")
DEFAULT_KEYS = tuple(key for key in MODEL_KEYS if key not in ("name", "model_path"))

_HINTS: Mapping[str, str] = {
    "gpus": "gpu_types (the allowed GPU types) or gpus_per_replica (how many)",
    "gpu": "gpu_types (the allowed GPU types) or gpus_per_replica (how many)",
    "gpu_type": "gpu_types",
    "gres_type": "gres_types",
    "gres": "gres_types (Slurm's GPU type names) or gpus_per_replica (how many)",
    "tp": "gpus_per_replica",
    "partition": "partitions",
    "time": "time_limit",
    "replicas": "min_replicas and max_replicas",
    "sbatch_arg": "sbatch_args",
    "model": "name",
    "path": "model_path",
}


# -- the spec ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Mesh-wide hard limits: jobs and GPUs the controller holds at once, never exceeded."""

    max_jobs: int
    max_gpus: int


@dataclass(frozen=True)
class ModelService:
    """One ``[[model]]`` with its defaults applied and every value normalised.

    Durations are seconds (whole milliseconds); ``idle_to_zero_s`` is None for a model that
    does not scale to zero (min_replicas >= 1); ``gpus_per_replica`` None means ``"auto"`` (the
    planner picks the tensor-parallel degree); empty ``gpu_types``/``partitions`` and None
    ``account``/``qos``/``time_limit_s`` leave the choice to the controller and the site."""

    name: str
    engine: str  # "sim", or a command template (single-spaced, fabricnode.engine.template)
    model_path: str | None = None  # what {model_path} becomes; None: the name
    gpu_types: tuple[str, ...] = ()  # catalog names, in order of preference; () = any
    gres_types: tuple[str, ...] = ()  # Slurm's names of those types (--gres=gpu:TYPE:N)
    gpus_per_replica: int | None = None
    min_replicas: int = DEFAULT_MIN_REPLICAS
    max_replicas: int = DEFAULT_MIN_REPLICAS
    ttft_p95_s: float | None = None
    idle_to_zero_s: float | None = None  # None unless min_replicas is 0
    hold_requests_s: float = DEFAULT_HOLD_REQUESTS_MS / 1000
    partitions: tuple[str, ...] = ()  # in order of preference; () = the site's default
    account: str | None = None
    qos: str | None = None
    time_limit_s: int | None = None
    sbatch_args: tuple[str, ...] = ()
    sleep_after_s: float | None = None  # the jobs' engines sleep after this idle time

    @property
    def simulated(self) -> bool:
        return self.engine == SIM

    @property
    def time_limit(self) -> str | None:
        """The time limit in Slurm's form (``HH:MM:SS``, ``D-HH:MM:SS``), for ``--time``."""
        return None if self.time_limit_s is None else format_time_limit(self.time_limit_s)

    def engine_template(self) -> EngineTemplate:
        """The engine template a node renders for this model (with its ``{model_path}``)."""
        words = () if self.simulated else tuple(shlex.split(self.engine))
        paths = {self.name: self.model_path} if self.model_path is not None else {}
        return EngineTemplate(words, paths)

    def _row(self) -> list[object]:
        row: list[object] = [
            self.name,
            self.engine,
            self.model_path,
            list(self.gpu_types),
            self.gpus_per_replica or 0,
            self.min_replicas,
            self.max_replicas,
            None if self.ttft_p95_s is None else _ms(self.ttft_p95_s),
            None if self.idle_to_zero_s is None else _ms(self.idle_to_zero_s),
            _ms(self.hold_requests_s),
            list(self.partitions),
            self.account,
            self.qos,
            self.time_limit_s,
            list(self.sbatch_args),
        ]
        extensions: list[object] = [
            None if self.sleep_after_s is None else _ms(self.sleep_after_s),
            list(self.gres_types),
        ]
        while extensions and extensions[-1] in (None, []):
            extensions.pop()  # ROW_EXTENSIONS: only up to the last one set
        return row + extensions

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "engine": self.engine,
            "model_path": self.model_path,
            "gpu_types": list(self.gpu_types),
            "gres_types": list(self.gres_types),
            "gpus_per_replica": AUTO if self.gpus_per_replica is None else self.gpus_per_replica,
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "ttft_p95_s": self.ttft_p95_s,
            "idle_to_zero_s": self.idle_to_zero_s,
            "hold_requests_s": self.hold_requests_s,
            "partitions": list(self.partitions),
            "account": self.account,
            "qos": self.qos,
            "time_limit_s": self.time_limit_s,
            "time_limit": self.time_limit,
            "sbatch_args": list(self.sbatch_args),
            "sleep_after_s": self.sleep_after_s,
        }

    def _toml_lines(self) -> list[str]:
        gpus = AUTO if self.gpus_per_replica is None else self.gpus_per_replica
        values: list[tuple[str, object]] = [
            ("name", self.name),
            ("engine", self.engine),
            ("model_path", self.model_path),
            ("gpu_types", list(self.gpu_types) or None),
            ("gres_types", list(self.gres_types) or None),
            ("gpus_per_replica", gpus),
            ("min_replicas", self.min_replicas),
            ("max_replicas", self.max_replicas),
            ("ttft_p95", _duration_or_none(self.ttft_p95_s)),
            ("idle_to_zero", _duration_or_none(self.idle_to_zero_s)),
            ("hold_requests", format_duration(self.hold_requests_s)),
            ("partitions", list(self.partitions) or None),
            ("account", self.account),
            ("qos", self.qos),
            ("time_limit", self.time_limit),
            ("sbatch_args", list(self.sbatch_args) or None),
            ("sleep_after", _duration_or_none(self.sleep_after_s)),
        ]
        return [f"{key} = {_toml_value(value)}" for key, value in values if value is not None]


@dataclass(frozen=True)
class ServiceSpec:
    """A whole service file, checked and normalised: the limits and the models, by name.

    ``parse``, ``load`` and ``from_canonical`` build it after every check; one built directly
    (tests, the renderer's laws) is taken as it is."""

    limits: Limits
    models: tuple[ModelService, ...] = ()  # sorted by name, case-insensitively
    version: int = FORMAT_VERSION
    _by_name: Mapping[str, ModelService] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        models = tuple(sorted(self.models, key=lambda m: (m.name.casefold(), m.name)))
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "_by_name", {m.name.casefold(): m for m in models})

    def model(self, name: str) -> ModelService | None:
        """The model called ``name`` (names are unique case-insensitively)."""
        return self._by_name.get(name.casefold())

    def canonical(self) -> bytes:
        """The bytes a signature covers: the same for every file that means this spec."""
        return canonical(
            DOMAIN,
            self.version,
            [self.limits.max_jobs, self.limits.max_gpus],
            [model._row() for model in self.models],
        )

    def digest(self) -> str:
        """16 hex digits naming this spec (sha256 of the canonical bytes)."""
        return hashlib.sha256(self.canonical()).hexdigest()[:16]

    def to_json(self) -> dict[str, object]:
        """A JSON-ready document, keys in a fixed order (``fabric services --json``)."""
        return {
            "version": self.version,
            "digest": self.digest(),
            "limits": {"max_jobs": self.limits.max_jobs, "max_gpus": self.limits.max_gpus},
            "models": [model.to_json() for model in self.models],
        }

    def to_toml(self) -> str:
        """A service file meaning exactly this spec: every model with every key it sets,
        defaults applied (``parse(spec.to_toml())`` gives the spec back)."""
        count = f"{len(self.models)} model{'s' * (len(self.models) != 1)}"
        lines = [
            f"# fabric service file: {count}, digest {self.digest()}",
            f"version = {self.version}",
            "",
            "[limits]",
            f"max_jobs = {self.limits.max_jobs}",
            f"max_gpus = {self.limits.max_gpus}",
        ]
        for model in self.models:
            lines += ["", "[[model]]", *model._toml_lines()]
        return "\n".join(lines) + "\n"


# -- reading -----------------------------------------------------------------------------------


def parse(text: str, origin: str = "<service file>", catalog: Catalog | None = None) -> ServiceSpec:
    """The spec of a service file's text; ``ServiceFileError`` listing every problem if it
    is not valid. ``origin`` names the file in errors; GPU types are checked against
    ``catalog`` (default: the built-in one)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ServiceFileError(origin, [_syntax_problem(origin, text, exc)]) from None
    return _Checker(origin, _locate(text), catalog or builtin_catalog()).spec(doc)


def load(path: str | Path, catalog: Catalog | None = None) -> ServiceSpec:
    """``parse`` of the file at ``path``; a file that cannot be read is a ServiceFileError."""
    origin = str(path)
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        why = f"cannot read the service file: {exc.strerror or exc}"
        raise ServiceFileError(origin, [FileProblem(origin, 0, "", "", why)]) from None
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text (byte {exc.start})"
        raise ServiceFileError(origin, [FileProblem(origin, 0, "", "", why)]) from None
    return parse(text, origin, catalog)


def from_canonical(data: bytes, catalog: Catalog | None = None) -> ServiceSpec:
    """The spec whose canonical bytes are ``data``; DecodeError if they are malformed, do not
    check as a service file would, or are not canonical (not what ``canonical()`` gives)."""
    try:
        fields = codec.unpack(data, max_bytes=MAX_CANONICAL_BYTES)
    except DecodeError as exc:
        raise DecodeError(f"service spec: {exc}") from None
    doc = _doc_of(fields)
    try:
        spec = _Checker("<canonical>", _Locator(""), catalog or builtin_catalog()).spec(doc)
    except ServiceFileError as exc:
        raise DecodeError(f"service spec: {exc}") from None
    if spec.canonical() != data:
        raise DecodeError("service spec: not in canonical form")
    return spec


_DURATION_KEYS = ("ttft_p95", "idle_to_zero", "hold_requests", "sleep_after")


def _doc_of(fields: object) -> dict[str, Any]:
    """The TOML document canonical ``fields`` stand for (checked by ``_Checker`` afterwards)."""
    if not (isinstance(fields, list) and len(fields) == 4 and fields[0] == DOMAIN):
        raise DecodeError("service spec: not a [domain, version, limits, models] array")
    _, version, limits, rows = fields
    if not (isinstance(limits, list) and len(limits) == 2 and isinstance(rows, list)):
        raise DecodeError("service spec: malformed limits or models")
    models = []
    for row in rows:
        keys = (*ROW_KEYS, *ROW_EXTENSIONS)
        if not (isinstance(row, list) and len(ROW_KEYS) <= len(row) <= len(keys)):
            raise DecodeError("service spec: malformed model")
        values = dict(zip(keys, row, strict=False))
        for key in ("gpus_per_replica", *_DURATION_KEYS):
            if values.get(key) is not None and (type(values[key]) is not int or values[key] < 0):
                raise DecodeError(f"service spec: {key}: not a count")
        if values["time_limit"] is not None and type(values["time_limit"]) is not int:
            raise DecodeError("service spec: time_limit: not seconds")
        model: dict[str, object] = {}
        for key, value in values.items():
            if value is None or value == []:
                continue
            if key in _DURATION_KEYS:
                value = f"{value}ms"
            elif key == "gpus_per_replica" and value == 0:
                value = AUTO
            elif key == "time_limit" and isinstance(value, int):
                value = format_time_limit(value)
            model[key] = value
        models.append(model)
    limits_doc = dict(zip(LIMIT_KEYS, limits, strict=True))
    return {"version": version, "limits": limits_doc, "model": models}


# -- rendering ---------------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    """``"500ms"``, ``"2s"``, ``"10m"``, ``"1h"``: the largest unit that is exact."""
    ms = _ms(seconds)
    if ms == 0:
        return "0s"
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def format_time_limit(seconds: int) -> str:
    """Slurm's ``HH:MM:SS``, or ``D-HH:MM:SS`` from one day."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{clock}" if days else clock


def _duration_or_none(seconds: float | None) -> str | None:
    return None if seconds is None else format_duration(seconds)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return str(value)


_PLAIN_WORD = re.compile(r"[^\s'\"\\]+")


def join_command(words: Iterable[str]) -> str:
    """The words as one shell line that ``shlex.split`` reads back, quoting only what needs
    it (``shlex.join`` would quote every ``{placeholder}``)."""
    return " ".join(w if _PLAIN_WORD.fullmatch(w) else shlex.quote(w) for w in words)


# -- checking ----------------------------------------------------------------------------------


class _Bad(Exception):
    """A value that does not check; ``index`` is the list entry at fault, if one is."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.index = index


def _show(value: object) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, dict):
        text = "a table"
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: object) -> str:
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


def _integer(low: int, high: int) -> Callable[[object], int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            hint = " (without quotes)" if isinstance(value, str) and value.isdigit() else ""
            raise _Bad(f"expected an integer{hint}, got {_show(value)}")
        if not low <= value <= high:
            raise _Bad(f"expected {low}..{high}, got {value}")
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
            raise _Bad(f"expected {expected}, got {_show(value)}")
        if isinstance(value, int | float):
            exact = float(value) * 1000
        elif isinstance(value, str) and _DURATION.fullmatch(value.strip()):
            parts = _DURATION_PART.findall(value)
            exact = sum(float(number) * _UNIT_MS[unit] for number, unit in parts)
        else:
            raise _Bad(f"expected {expected}, got {_show(value)}")
        if math.isnan(exact):
            raise _Bad(f"expected {expected}, got {_show(value)}")
        if exact > high_ms:  # inf too
            raise _Bad(f"at most {format_duration(high_ms / 1000)}, got {_show(value)}")
        ms = round(max(exact, -1.0))
        if ms < 0 or (ms == 0 and not allow_zero):
            raise _Bad(
                f"must be {'0 or more' if allow_zero else 'more than 0'}, got {_show(value)}"
            )
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
        raise _Bad(
            "expected a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) or "
            f"minutes as an integer, got {_show(value)}{hint}"
        )
    if seconds < MIN_TIME_LIMIT_S:
        raise _Bad(f"{_show(value)} is under {MIN_TIME_LIMIT_S // 60} minutes")
    if seconds > MAX_TIME_LIMIT_S:
        raise _Bad(f"{_show(value)} is over {MAX_TIME_LIMIT_S // 86400} days")
    return seconds


def _text(value: object, what: str, limit: int = MAX_TEXT, spaces: bool = True) -> str:
    if not isinstance(value, str):
        raise _Bad(f"expected {what} (a string), got {_kind(value)}")
    if not value.strip():
        raise _Bad(f"expected {what}, got an empty string")
    if len(value) > limit:
        raise _Bad(f"{what} longer than {limit} characters")
    if not value.isprintable() or (not spaces and any(c.isspace() for c in value)):
        bad = "unprintable characters" if spaces else "spaces or unprintable characters"
        raise _Bad(f"{what} {_show(value)} contains {bad}")
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
            raise _Bad(f"{what} {_show(text)} contains {' '.join(bad)}")
        return text

    return check


def _list(
    item: Callable[[object], str], what: str, key_of: Callable[[str], str] = str.casefold
) -> Callable[[object], tuple[str, ...]]:
    def check(value: object) -> tuple[str, ...]:
        if not isinstance(value, list):
            single = f" (write [{_show(value)}])" if isinstance(value, str) else ""
            raise _Bad(f"expected a list of {what}{single}, got {_kind(value)}")
        if not value:
            raise _Bad("empty list: omit the key instead")
        if len(value) > MAX_LIST:
            raise _Bad(f"more than {MAX_LIST} entries")
        items: list[str] = []
        seen: dict[str, int] = {}
        for index, entry in enumerate(value):
            try:
                checked = item(entry)
            except _Bad as exc:
                raise _Bad(exc.message, index) from None
            first = seen.setdefault(key_of(checked), index)
            if first != index:
                again, before = _show(entry), _show(value[first])
                twice = "is listed twice" if again == before else f"is the same as {before}"
                raise _Bad(f"{again} {twice}", index)
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
            raise _Bad(f"unknown GPU type {_show(name)} (known: {known}, or an alias)") from None

    return _list(gpu, "GPU types", key_of=lambda name: name)


def _gpus_per_replica(value: object) -> int | None:
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f'expected an integer 1..{MAX_PARALLEL} or "auto", got {_show(value)}')
    if not 1 <= value <= MAX_PARALLEL:
        raise _Bad(f'expected 1..{MAX_PARALLEL} or "auto", got {value}')
    return value


def _engine(value: object) -> str:
    what = 'an engine command template, "vllm", "sglang" or "sim"'
    if not isinstance(value, str):
        raise _Bad(f"expected {what} (a string), got {_kind(value)}")
    text = value.strip()
    if not text:
        raise _Bad(f"expected {what}, got an empty string")
    if len(text) > MAX_ENGINE:
        raise _Bad(f"longer than {MAX_ENGINE} characters")
    if not all(c.isprintable() or c in "\t\n\r" for c in text):
        raise _Bad("contains unprintable characters")
    if text == SIM:
        return SIM
    text = ENGINE_SHORTHANDS.get(text, text)
    try:
        return join_command(template_words(text))
    except ConfigError as exc:
        raise _Bad(str(exc)) from None


def _placeholders(engine: str) -> set[str]:
    if engine == SIM:
        return set()
    return {
        name
        for word in shlex.split(engine)
        for _, name, _, _ in string.Formatter().parse(word)
        if name is not None
    }


def _sbatch_args(value: object) -> tuple[str, ...]:
    args = _list(lambda v: _text(v, "an sbatch option"), "sbatch options", key_of=str)(value)
    takes_value = False
    for index, arg in enumerate(args):
        if not arg.startswith("-"):
            if not takes_value:
                raise _Bad(f"{_show(arg)} is not an sbatch option (they start with -)", index)
            takes_value = False
            continue
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            owned = [o for o in _OWNED_SBATCH if len(name) >= 3 and o.startswith(name)]
            owned = [name] if name in _OWNED_SBATCH else owned
            takes_value = "=" not in arg
        else:
            short = _SHORT_SBATCH.get(arg[1:2])
            owned = [short] if short else []
            takes_value = len(arg) == 2
        if owned:
            use = _OWNED_SBATCH[owned[0]]
            raise _Bad(f"{arg} is not allowed here: use {use}", index)
    return args


@dataclass
class _Draft:
    """One ``[[model]]`` while it is checked: its values (own or default), where they came
    from, and the keys that failed (no further check uses them)."""

    index: int
    own: set[str]
    values: dict[str, Any] = field(default_factory=dict)
    bad: set[str] = field(default_factory=set)
    where: str = ""

    def ok(self, *keys: str) -> bool:
        return not self.bad.intersection(keys)


class _Checker:
    """Checks one document, collecting every problem (rule 1)."""

    def __init__(self, origin: str, locator: _Locator, catalog: Catalog) -> None:
        self.origin = origin
        self.locator = locator
        self.problems: list[FileProblem] = []
        self.fields: dict[str, Callable[[object], Any]] = {
            "name": _name,
            "engine": _engine,
            "model_path": _model_path,
            "gpu_types": _gpu_types(catalog),
            "gres_types": _list(_word("a Slurm GPU type", ",:"), "Slurm GPU types", key_of=str),
            "gpus_per_replica": _gpus_per_replica,
            "min_replicas": _integer(0, MAX_REPLICAS),
            "max_replicas": _integer(1, MAX_REPLICAS),
            "ttft_p95": _duration_ms(False, MAX_TTFT_MS),
            "idle_to_zero": _duration_ms(False, MAX_IDLE_MS),
            "hold_requests": _duration_ms(True, MAX_HOLD_MS),
            "partitions": _list(_word("a partition", ","), "partitions", key_of=str),
            "account": _word("an account"),
            "qos": _word("a QOS"),
            "time_limit": _time_limit,
            "sbatch_args": _sbatch_args,
            "sleep_after": _duration_ms(False, MAX_SLEEP_AFTER_MS),
        }
        self.defaults: dict[str, Any] = {}
        self.bad_defaults: set[str] = set()
        self.default_keys: set[str] = set()

    def report(self, path: Sequence[object], where: str, key: str, message: str) -> None:
        self.problems.append(FileProblem(self.origin, self.locator.line(path), where, key, message))

    def spec(self, doc: dict[str, Any]) -> ServiceSpec:
        self.top(doc)
        self.read_defaults(doc.get("defaults"))
        limits = self.limits(doc.get("limits"))
        drafts = self.models(doc.get("model"), limits)
        self.budget(drafts, limits)
        if self.problems or limits is None:
            problems = sorted(self.problems, key=lambda p: p.line)
            raise ServiceFileError(self.origin, problems)
        models = [_model_of(d.values) for d in drafts]
        return ServiceSpec(limits, tuple(models), FORMAT_VERSION)

    def unknown(
        self,
        table: Mapping[str, object],
        allowed: Sequence[str],
        path: tuple[object, ...],
        where: str,
    ) -> None:
        for key in table:
            if key in allowed:
                continue
            hint = _HINTS.get(key) or next(iter(difflib.get_close_matches(key, allowed, 1)), None)
            if key in ("name", "model_path") and where == "[defaults]":
                message = "unknown key: it cannot be a default, give it in each [[model]]"
            elif key in LIMIT_KEYS and where != "[limits]":
                message = "unknown key here: it belongs in [limits]"
            else:
                guess = f"; did you mean {hint}?" if hint and hint != key else ""
                message = f"unknown key{guess} (allowed: {', '.join(allowed)})"
            self.report((*path, key), where, key, message)

    def top(self, doc: dict[str, Any]) -> None:
        self.unknown(doc, TOP_KEYS, (), "")
        if "version" in doc:
            version = doc["version"]
            if isinstance(version, bool) or version != FORMAT_VERSION:
                self.report(
                    ("version",),
                    "",
                    "version",
                    f"unsupported format version {_show(version)} (this fabric reads "
                    f"version {FORMAT_VERSION})",
                )

    def read_defaults(self, table: object) -> None:
        if table is None:
            return
        if not isinstance(table, dict):
            self.report(("defaults",), "", "defaults", f"expected a table, got {_kind(table)}")
            return
        self.unknown(table, DEFAULT_KEYS, ("defaults",), "[defaults]")
        for key in DEFAULT_KEYS:
            if key not in table:
                continue
            self.default_keys.add(key)
            try:
                self.defaults[key] = self.fields[key](table[key])
            except _Bad as exc:
                self.bad_defaults.add(key)
                self.report(_entry(("defaults", key), exc), "[defaults]", key, exc.message)

    def limits(self, table: object) -> Limits | None:
        if table is None:
            self.report(
                (), "[limits]", "", "missing: the mesh-wide max_jobs and max_gpus are required"
            )
            return None
        if not isinstance(table, dict):
            self.report(("limits",), "", "limits", f"expected a table, got {_kind(table)}")
            return None
        self.unknown(table, LIMIT_KEYS, ("limits",), "[limits]")
        values: dict[str, int] = {}
        for key, high in (("max_jobs", MAX_JOBS), ("max_gpus", MAX_GPUS)):
            if key not in table:
                self.report(("limits",), "[limits]", key, "missing (required)")
                continue
            try:
                values[key] = _integer(1, high)(table[key])
            except _Bad as exc:
                self.report(("limits", key), "[limits]", key, exc.message)
        if len(values) != len(LIMIT_KEYS):
            return None
        return Limits(values["max_jobs"], values["max_gpus"])

    def models(self, tables: object, limits: Limits | None) -> list[_Draft]:
        if tables is None:
            return []
        if not isinstance(tables, list):
            self.report(
                ("model",),
                "",
                "model",
                "expected [[model]] tables, one per model (write [[model]], not [model])",
            )
            return []
        if len(tables) > MAX_MODELS:
            self.report(("model",), "", "model", f"more than {MAX_MODELS} models")
        drafts: list[_Draft] = []
        names: dict[str, _Draft] = {}
        for index, table in enumerate(tables):
            if not isinstance(table, dict):
                where = f"[[model]] #{index + 1}"
                self.report(("model", index), where, "", f"expected a table, got {_kind(table)}")
                continue
            draft = self.model(index, table, limits)
            if draft.ok("name") and "name" in draft.values:
                first = names.setdefault(draft.values["name"].casefold(), draft)
                if first is not draft:
                    line = self.locator.line(("model", first.index, "name"))
                    at = f" at line {line}" if line else ""
                    self.report(
                        ("model", index, "name"),
                        draft.where,
                        "name",
                        f"{_show(draft.values['name'])} is already the name of the [[model]]"
                        f"{at} (names are compared case-insensitively)",
                    )
            drafts.append(draft)
        return drafts

    def model(self, index: int, table: dict[str, Any], limits: Limits | None) -> _Draft:
        draft = _Draft(index, set(table), where=f"[[model]] #{index + 1}")
        path = ("model", index)
        if "name" in table:
            try:
                draft.values["name"] = _name(table["name"])
                draft.where = f"[[model]] {_show(draft.values['name'])}"
            except _Bad as exc:
                draft.bad.add("name")
                self.report((*path, "name"), draft.where, "name", exc.message)
        else:
            draft.bad.add("name")
            self.report(path, draft.where, "name", "missing: every [[model]] needs a name")
        self.unknown(table, MODEL_KEYS, path, draft.where)
        for key in MODEL_KEYS[1:]:
            if key in table:
                try:
                    draft.values[key] = self.fields[key](table[key])
                except _Bad as exc:
                    draft.bad.add(key)
                    self.report(_entry((*path, key), exc), draft.where, key, exc.message)
            elif key in self.defaults:
                draft.values[key] = self.defaults[key]
            elif key in self.bad_defaults:
                draft.bad.add(key)
        if "engine" not in draft.values and draft.ok("engine"):
            draft.bad.add("engine")
            self.report(
                path,
                draft.where,
                "engine",
                'missing: an engine command template, "vllm", "sglang" or "sim" (here or in '
                "[defaults])",
            )
        self.cross_check(draft, limits)
        return draft

    def line_key(self, draft: _Draft, *keys: str) -> tuple[tuple[object, ...], str]:
        """Where to report a problem of several keys: the first the model sets itself, else
        the first set in [defaults], else the model's header."""
        for key in keys:
            if key in draft.own:
                return ("model", draft.index, key), key
        for key in keys:
            if key in self.default_keys:
                return ("defaults", key), key
        return ("model", draft.index), keys[0]

    def origin_of(self, draft: _Draft, key: str) -> str:
        return " (from [defaults])" if key not in draft.own and key in self.defaults else ""

    def cross_check(self, draft: _Draft, limits: Limits | None) -> None:
        values = draft.values
        low = values.setdefault("min_replicas", DEFAULT_MIN_REPLICAS)
        if draft.ok("min_replicas", "max_replicas"):
            high = values.setdefault("max_replicas", max(low, 1))
            if high < low:
                path, key = self.line_key(draft, "max_replicas", "min_replicas")
                high_t = f"{high}{self.origin_of(draft, 'max_replicas')}"
                low_t = f"{low}{self.origin_of(draft, 'min_replicas')}"
                message = (
                    f"{high_t} is below min_replicas {low_t}"
                    if key == "max_replicas"
                    else f"{low_t} is above max_replicas {high_t}"
                )
                self.report(path, draft.where, key, message)
        if "idle_to_zero" in draft.own and draft.ok("min_replicas", "idle_to_zero") and low > 0:
            self.report(
                ("model", draft.index, "idle_to_zero"),
                draft.where,
                "idle_to_zero",
                f"applies only to a model that scales to zero (min_replicas = 0), not to "
                f"min_replicas {low}{self.origin_of(draft, 'min_replicas')}",
            )
        if "model_path" in draft.own and draft.ok("engine", "model_path") and "engine" in values:
            engine = values["engine"]
            if engine != SIM and "model_path" not in _placeholders(engine):
                self.report(
                    ("model", draft.index, "model_path"),
                    draft.where,
                    "model_path",
                    "the engine does not use {model_path}: put {model_path} in its template, "
                    "or drop model_path",
                )
        kinds, names = values.get("gpu_types"), values.get("gres_types")
        if kinds and names and len(kinds) != len(names) and draft.ok("gpu_types", "gres_types"):
            path, key = self.line_key(draft, "gres_types")
            self.report(
                path,
                draft.where,
                key,
                f"{len(names)} Slurm GPU type(s) for {len(kinds)} gpu_types: give Slurm's name "
                f"of each GPU type, in the same order ({', '.join(kinds)})",
            )
        gpus = values.get("gpus_per_replica")
        if limits is not None and gpus is not None and gpus > limits.max_gpus:
            path, key = self.line_key(draft, "gpus_per_replica")
            self.report(
                path,
                draft.where,
                key,
                f"{gpus} GPUs per replica{self.origin_of(draft, key)} is more than "
                f"[limits] max_gpus {limits.max_gpus}: not one replica could run",
            )

    def budget(self, drafts: list[_Draft], limits: Limits | None) -> None:
        """The models' min_replicas must fit the limits (a lower bound when some model is
        bad: the ones that checked already need this much)."""
        if limits is None:
            return
        jobs: list[tuple[str, int]] = []
        gpus: list[tuple[str, int]] = []
        autos = False
        for draft in drafts:
            if not draft.ok("min_replicas", "gpus_per_replica", "name"):
                continue
            low = draft.values["min_replicas"]
            if low:
                jobs.append((draft.values["name"], low))
                per = draft.values.get("gpus_per_replica")
                autos = autos or per is None
                gpus.append((draft.values["name"], low * (per or 1)))  # "auto": at least 1
        for key, limit, needs, unit in (
            ("max_jobs", limits.max_jobs, jobs, "jobs"),
            ("max_gpus", limits.max_gpus, gpus, "GPUs"),
        ):
            total = sum(n for _, n in needs)
            if total > limit:
                shown = ", ".join(f"{name} {n}" for name, n in needs[:6])
                more = ", ..." if len(needs) > 6 else ""
                auto = " (auto counts 1 GPU per replica)" if unit == "GPUs" and autos else ""
                self.report(
                    ("limits", key),
                    "[limits]",
                    key,
                    f"{limit} is less than the {total} {unit} the models' min_replicas "
                    f"need{auto}: {shown}{more}",
                )


def _entry(path: tuple[object, ...], exc: _Bad) -> tuple[object, ...]:
    return path if exc.index is None else (*path, exc.index)


def _model_of(values: Mapping[str, Any]) -> ModelService:
    def seconds(ms: int | None) -> float | None:
        return None if ms is None else ms / 1000

    return ModelService(
        name=values["name"],
        engine=values["engine"],
        model_path=values.get("model_path"),
        gpu_types=values.get("gpu_types", ()),
        gres_types=values.get("gres_types", ()),
        gpus_per_replica=values.get("gpus_per_replica"),
        min_replicas=values["min_replicas"],
        max_replicas=values["max_replicas"],
        ttft_p95_s=seconds(values.get("ttft_p95")),
        idle_to_zero_s=seconds(values.get("idle_to_zero", DEFAULT_IDLE_TO_ZERO_MS))
        if values["min_replicas"] == 0
        else None,
        hold_requests_s=values.get("hold_requests", DEFAULT_HOLD_REQUESTS_MS) / 1000,
        partitions=values.get("partitions", ()),
        account=values.get("account"),
        qos=values.get("qos"),
        time_limit_s=values.get("time_limit"),
        sbatch_args=values.get("sbatch_args", ()),
        sleep_after_s=seconds(values.get("sleep_after")),
    )


_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


def _syntax_problem(origin: str, text: str, exc: tomllib.TOMLDecodeError) -> FileProblem:
    message = str(exc)
    found = _TOML_POSITION.search(message)
    if found:
        line = int(found.group(1))
        message = f"{message[: found.start()]} (column {found.group(2)})"
    else:
        line = max(1, text.count("\n") + (0 if text.endswith("\n") else 1))
        message = message.replace(" (at end of document)", " (at the end of the file)")
    return FileProblem(origin, line, "", "", f"not valid TOML: {message}")


# -- line numbers ------------------------------------------------------------------------------


class _ScanError(Exception):
    """The locator met something it does not read (it then gives no lines, never a wrong one)."""


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _locate(text: str) -> _Locator:
    try:
        return _Locator(text)
    except (_ScanError, IndexError, ValueError):
        return _Locator("")


class _Locator:
    """The first line of every table header, key and array element of a valid TOML
    document, by path (module docstring)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines: dict[tuple[object, ...], int] = {}
        self._newlines = [i for i, c in enumerate(text) if c == "\n"]
        self._arrays: dict[tuple[object, ...], int] = {}  # [[array]] path -> its last index
        self._i = 0
        self._scan()

    def line(self, path: Sequence[object]) -> int:
        """The line of ``path``, or of its longest prefix that has one (0: none)."""
        for end in range(len(path), 0, -1):
            found = self.lines.get(tuple(path[:end]))
            if found:
                return found
        return 0

    def _line_here(self) -> int:
        return bisect_left(self._newlines, self._i) + 1

    def _peek(self, ahead: int = 0) -> str:
        at = self._i + ahead
        return self.text[at] if at < len(self.text) else ""

    def _skip(self, newlines: bool) -> None:
        text = self.text
        while self._i < len(text):
            c = text[self._i]
            if c in " \t" or (newlines and c in "\r\n"):
                self._i += 1
            elif c == "#":
                end = text.find("\n", self._i)
                self._i = len(text) if end < 0 else end
            else:
                return

    def _expect(self, token: str) -> None:
        if not self.text.startswith(token, self._i):
            raise _ScanError(f"expected {token!r} at {self._i}")
        self._i += len(token)

    def _scan(self) -> None:
        table: tuple[object, ...] = ()
        while True:
            self._skip(newlines=True)
            if self._i >= len(self.text):
                return
            line = self._line_here()
            if self._peek() == "[":
                array = self._peek(1) == "["
                self._i += 2 if array else 1
                table = self._header(self._key(), array, line)
                self._skip(newlines=False)
                self._expect("]]" if array else "]")
            else:
                self._pair(table, line)

    def _header(self, keys: tuple[str, ...], array: bool, line: int) -> tuple[object, ...]:
        path: tuple[object, ...] = ()
        for n, key in enumerate(keys):
            path = (*path, key)
            if array and n == len(keys) - 1:
                self.lines.setdefault(path, line)
                index = self._arrays.get(path, -1) + 1
                self._arrays[path] = index
                path = (*path, index)
            elif path in self._arrays:
                path = (*path, self._arrays[path])
        self.lines.setdefault(path, line)
        return path

    def _pair(self, table: tuple[object, ...], line: int) -> None:
        keys = self._key()
        for end in range(1, len(keys) + 1):
            self.lines.setdefault((*table, *keys[:end]), line)
        self._skip(newlines=False)
        self._expect("=")
        self._skip(newlines=False)
        self._value((*table, *keys))

    def _key(self) -> tuple[str, ...]:
        keys: list[str] = []
        while True:
            self._skip(newlines=False)
            c = self._peek()
            if c == '"':
                start = self._i
                self._basic_string()
                keys.append(tomllib.loads("k = " + self.text[start : self._i])["k"])
            elif c == "'":
                end = self.text.index("'", self._i + 1)
                keys.append(self.text[self._i + 1 : end])
                self._i = end + 1
            else:
                found = _BARE_KEY.match(self.text, self._i)
                if found is None:
                    raise _ScanError(f"no key at {self._i}")
                keys.append(found.group())
                self._i = found.end()
            self._skip(newlines=False)
            if self._peek() != ".":
                return tuple(keys)
            self._i += 1

    def _value(self, path: tuple[object, ...]) -> None:
        text = self.text
        c = self._peek()
        if c == "{":
            self._i += 1
            while True:
                self._skip(newlines=True)
                if self._peek() == "}":
                    self._i += 1
                    return
                if self._peek() == ",":
                    self._i += 1
                    continue
                self._pair(path, self._line_here())
        elif c == "[":
            self._i += 1
            index = 0
            while True:
                self._skip(newlines=True)
                if self._peek() == "]":
                    self._i += 1
                    return
                if self._peek() == ",":
                    self._i += 1
                    continue
                self.lines.setdefault((*path, index), self._line_here())
                self._value((*path, index))
                index += 1
        elif text.startswith('"""', self._i):
            self._multiline_string('"""', escapes=True)
        elif text.startswith("'''", self._i):
            self._multiline_string("'''", escapes=False)
        elif c == '"':
            self._basic_string()
        elif c == "'":
            self._i = text.index("'", self._i + 1) + 1
        elif c:
            while self._i < len(text) and text[self._i] not in ",]}\n#":
                self._i += 1
        else:
            raise _ScanError("value missing at the end")

    def _basic_string(self) -> None:
        text = self.text
        i = self._i + 1
        while text[i] != '"':
            i += 2 if text[i] == "\\" else 1
        self._i = i + 1

    def _multiline_string(self, quotes: str, escapes: bool) -> None:
        text = self.text
        i = self._i + 3
        while not text.startswith(quotes, i):
            if i >= len(text):
                raise _ScanError("unterminated string")
            i += 2 if escapes and text[i] == "\\" else 1
        i += 3
        while i < len(text) and text[i] == quotes[0]:  # up to two quotes end the content
            i += 1
        self._i = i
