"""The service file's spec: what a file means, its canonical bytes and its renderings.

``ServiceSpec`` (the limits and the models, by name) and ``ModelService`` (one ``[[model]]``
with its defaults applied and every value normalised) are what ``servicefile.parse`` yields and
what the controller plans from. This module holds them and what reads nothing but them: the
canonical bytes (``ServiceSpec.canonical``: what is signed and digested; rule 5 of
``servicefile``), the JSON document (``fabric services --json``) and the renderer back to TOML
(``ServiceSpec.to_toml``), with Slurm's time-limit form and the duration words they print.

Pure: no clock, no environment, no file; nothing of the engine or the host. ``vocab`` (which
the controller's pure pass shares) imports these records, so they stay inside the
``elastic-pure`` contract; the checks that build them are ``servicecheck``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fabricnode.mesh.identity import canonical

FORMAT_VERSION = 1
DOMAIN = b"fabric/services/v1"

DEFAULT_MIN_REPLICAS = 1
DEFAULT_IDLE_TO_ZERO_MS = 600_000  # 10m
DEFAULT_HOLD_REQUESTS_MS = 180_000  # 3m
AUTO = "auto"
# The engine templates' word for the built-in simulated engine (``fabricnode.engine.template``'s
# ``SIM``, the same word: a test holds them equal).
SIM = "sim"

# Bounds of the file's values.
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
MAX_SCALE_IN_HOLD_MS = 86_400_000  # a day: longer than any burst the hold is meant to ride out


# ``engine = "vllm"`` / ``"sglang"``: the command the researcher wrapper builds for each.
ENGINE_SHORTHANDS: Mapping[str, str] = {
    "vllm": "vllm serve {model_path} --served-model-name {model} --tensor-parallel-size {tp} "
    "--host {host} --port {port}",
    "sglang": "python3 -m sglang.launch_server --model-path {model_path} --served-model-name "
    "{model} --tp-size {tp} --host {host} --port {port}",
}

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
ROW_EXTENSIONS = ("sleep_after", "gres_types", "scale_in_hold", "sites", "prefer_sites")
MODEL_KEYS = (
    *ROW_KEYS[:4],
    "gres_types",
    *ROW_KEYS[4:],
    *("sleep_after", "scale_in_hold", "sites", "prefer_sites"),
)
DEFAULT_KEYS = tuple(key for key in MODEL_KEYS if key not in ("name", "model_path"))


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
    # how long demand must stay low before the controller scales in; None: the policy's default
    scale_in_hold_s: float | None = None
    # data residency: the only sites whose nodes may serve it (sorted); () = any site
    sites: tuple[str, ...] = ()
    # capacity across sites (``elastic.sitespread``): where its replicas go, first choice first;
    # with it, min_replicas and max_replicas count the replicas of every site listed, and each
    # site's controller places its share. () = each site's controller keeps its own replicas.
    prefer_sites: tuple[str, ...] = ()

    @property
    def simulated(self) -> bool:
        return self.engine == SIM

    @property
    def time_limit(self) -> str | None:
        """The time limit in Slurm's form (``HH:MM:SS``, ``D-HH:MM:SS``), for ``--time``."""
        return None if self.time_limit_s is None else format_time_limit(self.time_limit_s)

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
            None if self.scale_in_hold_s is None else _ms(self.scale_in_hold_s),
            list(self.sites),
            list(self.prefer_sites),
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
            "scale_in_hold_s": self.scale_in_hold_s,
            "sites": list(self.sites),
            "prefer_sites": list(self.prefer_sites),
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
            ("scale_in_hold", _duration_or_none(self.scale_in_hold_s)),
            ("sites", list(self.sites) or None),
            ("prefer_sites", list(self.prefer_sites) or None),
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
