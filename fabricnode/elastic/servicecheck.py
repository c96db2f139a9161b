"""Checking a service file: a parsed TOML document into a ``ServiceSpec``, or every problem.

``Checker`` walks one document (``servicefile.parse``'s, or the one ``from_canonical`` rebuilds
from canonical bytes) against the file's format (docs/services.md; rules 1 to 4 of
``servicefile``: all or nothing, unknown keys listed with a guess, ``[defaults]``, values
normalised). Each value goes through its check (``servicevalues``); a ``Bad`` becomes a
``FileProblem`` at its line (``tomllines``). Then the cross-checks: of one model (min and max
replicas, idle_to_zero, model_path against the template, GPU and GRES types, one replica within
``[limits]``) and of all of them (their min_replicas within ``[limits]``).

Pure in what it does, but it reaches ``host.slurm`` and ``engine.template`` through
``servicevalues``: outside the ``elastic-pure`` contract (``servicevalues`` says why).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.catalog import Catalog

from fabricnode.elastic.servicespec import (
    DEFAULT_HOLD_REQUESTS_MS,
    DEFAULT_IDLE_TO_ZERO_MS,
    DEFAULT_KEYS,
    DEFAULT_MIN_REPLICAS,
    FORMAT_VERSION,
    LIMIT_KEYS,
    MAX_GPUS,
    MAX_JOBS,
    MAX_MODELS,
    MODEL_KEYS,
    SIM,
    TOP_KEYS,
    Limits,
    ModelService,
    ServiceSpec,
)
from fabricnode.elastic.servicevalues import Bad, field_checks, integer, kind, placeholders, show
from fabricnode.elastic.tomllines import Locator
from fabricnode.errors import FileProblem, ServiceFileError

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


class Checker:
    """Checks one document, collecting every problem (rule 1)."""

    def __init__(self, origin: str, locator: Locator, catalog: Catalog) -> None:
        self.origin = origin
        self.locator = locator
        self.problems: list[FileProblem] = []
        self.fields = field_checks(catalog)
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
                    f"unsupported format version {show(version)} (this fabric reads "
                    f"version {FORMAT_VERSION})",
                )

    def read_defaults(self, table: object) -> None:
        if table is None:
            return
        if not isinstance(table, dict):
            self.report(("defaults",), "", "defaults", f"expected a table, got {kind(table)}")
            return
        self.unknown(table, DEFAULT_KEYS, ("defaults",), "[defaults]")
        for key in DEFAULT_KEYS:
            if key not in table:
                continue
            self.default_keys.add(key)
            try:
                self.defaults[key] = self.fields[key](table[key])
            except Bad as exc:
                self.bad_defaults.add(key)
                self.report(_entry(("defaults", key), exc), "[defaults]", key, exc.message)

    def limits(self, table: object) -> Limits | None:
        if table is None:
            self.report(
                (), "[limits]", "", "missing: the mesh-wide max_jobs and max_gpus are required"
            )
            return None
        if not isinstance(table, dict):
            self.report(("limits",), "", "limits", f"expected a table, got {kind(table)}")
            return None
        self.unknown(table, LIMIT_KEYS, ("limits",), "[limits]")
        values: dict[str, int] = {}
        for key, high in (("max_jobs", MAX_JOBS), ("max_gpus", MAX_GPUS)):
            if key not in table:
                self.report(("limits",), "[limits]", key, "missing (required)")
                continue
            try:
                values[key] = integer(1, high)(table[key])
            except Bad as exc:
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
                self.report(("model", index), where, "", f"expected a table, got {kind(table)}")
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
                        f"{show(draft.values['name'])} is already the name of the [[model]]"
                        f"{at} (names are compared case-insensitively)",
                    )
            drafts.append(draft)
        return drafts

    def model(self, index: int, table: dict[str, Any], limits: Limits | None) -> _Draft:
        draft = _Draft(index, set(table), where=f"[[model]] #{index + 1}")
        path = ("model", index)
        if "name" in table:
            try:
                draft.values["name"] = self.fields["name"](table["name"])
                draft.where = f"[[model]] {show(draft.values['name'])}"
            except Bad as exc:
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
                except Bad as exc:
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
            if engine != SIM and "model_path" not in placeholders(engine):
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
        allowed, preferred = values.get("sites"), values.get("prefer_sites")
        if allowed and preferred and draft.ok("sites", "prefer_sites"):
            outside = [s for s in preferred if s not in allowed]
            if outside:
                path, key = self.line_key(draft, "prefer_sites")
                self.report(
                    path,
                    draft.where,
                    key,
                    f"{', '.join(outside)} not in sites ({', '.join(allowed)}): the model may "
                    f"not be served there (data residency)",
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


def _entry(path: tuple[object, ...], exc: Bad) -> tuple[object, ...]:
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
        scale_in_hold_s=seconds(values.get("scale_in_hold")),
        sites=values.get("sites", ()),
        prefer_sites=values.get("prefer_sites", ()),
    )
