"""GPU and model catalogs: shipped as TOML data (scheduler/data/), extended by users' files.

Rules:

* The built-in catalogs are package data read with ``tomllib``; nothing is fetched from a hub.
  Every built-in entry names its datasheet or config.json in ``source``.
* A user file has the same shape: ``[gpus."NAME"]`` and/or ``[models."NAME"]`` tables (see the
  comments at the top of data/gpus.toml and data/models.toml for every field and its unit).
  A table whose name is already in the catalog *merges* into that entry: the fields it gives
  replace the old ones, the rest are kept (so ``[gpus.H100-SXM] bandwidth_efficiency = 0.8`` is a
  complete file). A new name must give every required field.
* Unknown fields, wrong types, non-positive numbers, inconsistent shapes (``heads`` not a
  multiple of ``kv_heads``) and names or aliases claimed by two entries are ``CatalogError``s
  that name the file and the table.
* Names are looked up case-insensitively, with spaces and underscores read as ``-``; model
  lookups also ignore an ``org/`` prefix and the suffixes ``-hf``, ``-instruct`` and ``-chat``.

Local models (Hugging Face ``config.json`` files and model directories, ``scheduler.hf_config``):

* ``load_catalog`` takes, besides TOML files, a ``config.json`` (any ``*.json``) or a directory
  holding one. Its entry is named by the directory's absolute path (``local_model_name``) and
  *replaces* an entry of that name; an alias (the directory's name, ``_name_or_path``) that
  another entry already claims is dropped, so a local ``Llama-2-13b-hf`` keeps its path name
  and ``llama-2-13b`` still means the built-in (``Catalog.with_model``).
* Model names starting with ``/``, ``~`` or ``.`` are local paths: matched as paths (absolute,
  ``~`` expanded, no trailing slash, ``config.json`` stripped), never by their last component.
* ``Catalog.model`` of a path-shaped name (a local path, or any name with a ``/``) the catalog
  does not hold as a path reads the ``config.json`` there, if there is one, *before* matching the
  name's last component: the file describes what is served from that directory (an AWQ
  checkpoint in a directory named like its base model). So the mesh's served ids, which are
  paths for engines serving a directory, plan without a catalog file. This is the catalog's only
  I/O; it reads each directory once and remembers the entry (``Catalog.models`` does not list
  it), so one plan sees one entry per model. Otherwise the last component is matched as above
  (a planner that cannot see the directory still knows ``/scratch/Llama-2-13b-hf``).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from scheduler import hf_config
from scheduler.errors import CatalogError
from scheduler.specs import GIB as GIB
from scheduler.specs import WEIGHT_BITS as WEIGHT_BITS
from scheduler.specs import GpuSpec as GpuSpec
from scheduler.specs import ModelSpec as ModelSpec
from scheduler.specs import is_local_path as is_local_path
from scheduler.specs import local_model_name as local_model_name

_NUM = (int, float)


@dataclass(frozen=True)
class _Field:
    kind: str  # "str", "int", "int0", "bits", "float", "bool", "strs", "fraction"
    required: bool


_GPU_FIELDS: dict[str, _Field] = {
    "vendor": _Field("str", True),
    "memory_gb": _Field("float", True),
    "bf16_tflops": _Field("float", True),
    "memory_bw_gbs": _Field("float", True),
    "link": _Field("str", True),
    "link_gbs": _Field("float", True),
    "link_latency_us": _Field("float", True),
    "gpus_per_node": _Field("int", True),
    "compute_efficiency": _Field("fraction", False),
    "bandwidth_efficiency": _Field("fraction", False),
    "aliases": _Field("strs", False),
    "source": _Field("str", False),
}

_MODEL_FIELDS: dict[str, _Field] = {
    "layers": _Field("int", True),
    "hidden": _Field("int", True),
    "heads": _Field("int", True),
    "kv_heads": _Field("int", True),
    "head_dim": _Field("int", False),
    "intermediate": _Field("int", True),
    "vocab": _Field("int", True),
    "max_context": _Field("int", True),
    "tie_embeddings": _Field("bool", False),
    "experts": _Field("int0", False),
    "experts_per_token": _Field("int0", False),
    "expert_intermediate": _Field("int0", False),
    "shared_expert_intermediate": _Field("int0", False),
    "weight_bits": _Field("bits", False),
    "aliases": _Field("strs", False),
    "source": _Field("str", False),
}


def _check_value(where: str, key: str, kind: str, value: object) -> object:
    bad = f"{where} field {key!r}"
    if kind == "str":
        if not isinstance(value, str) or not value.strip():
            raise CatalogError(f"{bad} must be a non-empty string, got {value!r}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise CatalogError(f"{bad} must be true or false, got {value!r}")
        return value
    if kind == "strs":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise CatalogError(f"{bad} must be a list of non-empty strings, got {value!r}")
        return tuple(value)
    if kind == "bits":
        if isinstance(value, bool) or not isinstance(value, int) or value not in WEIGHT_BITS:
            raise CatalogError(f"{bad} must be 4, 8, 16 or 32, got {value!r}")
        return value
    if kind in ("int", "int0"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise CatalogError(f"{bad} must be an integer, got {value!r}")
        if value < (1 if kind == "int" else 0):
            limit = "positive" if kind == "int" else "zero or more"
            raise CatalogError(f"{bad} must be {limit}, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, _NUM):
        raise CatalogError(f"{bad} must be a number, got {value!r}")
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise CatalogError(f"{bad} must be a positive number, got {value!r}")
    if kind == "fraction" and number > 1:
        raise CatalogError(f"{bad} must be a fraction in (0, 1], got {value!r}")
    return number


def _parse_table(
    where: str, table: object, schema: Mapping[str, _Field], base: Mapping[str, object] | None
) -> dict[str, object]:
    if not isinstance(table, dict):
        raise CatalogError(f"{where} must be a table of fields, got {table!r}")
    unknown = sorted(set(table) - set(schema))
    if unknown:
        raise CatalogError(
            f"{where} unknown field {unknown[0]!r} (known: {', '.join(sorted(schema))})"
        )
    values: dict[str, object] = dict(base or {})
    for key, value in table.items():
        values[key] = _check_value(where, key, schema[key].kind, value)
    missing = [k for k, f in schema.items() if f.required and k not in values]
    if missing:
        raise CatalogError(f"{where} missing required field {missing[0]!r}")
    return values


def _gpu_from(name: str, values: Mapping[str, object]) -> GpuSpec:
    return GpuSpec(name=name, **values)  # type: ignore[arg-type]


def _model_from(name: str, where: str, values: Mapping[str, object]) -> ModelSpec:
    v: dict[str, Any] = dict(values)
    if "head_dim" not in v:
        if v["hidden"] % v["heads"]:
            raise CatalogError(
                f"{where} hidden {v['hidden']} is not a multiple of heads "
                f"{v['heads']}: give head_dim"
            )
        v["head_dim"] = v["hidden"] // v["heads"]
    if v["heads"] % v["kv_heads"]:
        raise CatalogError(
            f"{where} heads {v['heads']} is not a multiple of kv_heads {v['kv_heads']}"
        )
    experts = v.get("experts", 0)
    if experts > 1:
        k = v.get("experts_per_token", 0)
        if not 1 <= k <= experts:
            raise CatalogError(f"{where} experts_per_token must be from 1 to experts ({experts})")
        v.setdefault("expert_intermediate", v["intermediate"])
        if v["expert_intermediate"] < 1:
            raise CatalogError(f"{where} expert_intermediate must be positive")
    return ModelSpec(name=name, **v)


# -- names ------------------------------------------------------------------------------------

_MODEL_SUFFIXES = ("-hf", "-instruct", "-chat")


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def _model_norm(name: str) -> str:
    key = _norm(name).rsplit("/", 1)[-1]
    stripped = True
    while stripped:
        stripped = False
        for suffix in _MODEL_SUFFIXES:
            if key.endswith(suffix) and len(key) > len(suffix):
                key, stripped = key[: -len(suffix)], True
    return key


def _model_key(name: str) -> str | None:
    return None if is_local_path(name) else _model_norm(name)


def _path_key(name: str) -> str | None:
    return local_model_name(name) if is_local_path(name) else None


class Catalog:
    """GPU types and models by name. Immutable; ``merged`` and ``with_model`` return a new
    catalog (``model`` remembers the local models it read, module docstring)."""

    def __init__(self, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec]) -> None:
        self.gpus: Mapping[str, GpuSpec] = dict(gpus)
        self.models: Mapping[str, ModelSpec] = dict(models)
        self._gpu_index = _index(self.gpus.values(), _norm, "GPU type")
        self._model_index = _index(self.models.values(), _model_key, "model")
        self._path_index = _index(self.models.values(), _path_key, "model")
        self._local: dict[str, ModelSpec | None] = {}

    def gpu(self, name: str) -> GpuSpec:
        """The GPU type called ``name`` (or one of its aliases); ``CatalogError`` if unknown."""
        found = self._gpu_index.get(_norm(name))
        if found is None:
            raise CatalogError(
                f"unknown GPU type {name!r} (known: {', '.join(sorted(self.gpus))}; "
                "add your own with a catalog file)"
            )
        return self.gpus[found]

    def model(self, name: str) -> ModelSpec:
        """The model called ``name`` (or one of its aliases), or the local model directory (or
        ``config.json``) a path-shaped ``name`` points at; ``CatalogError`` if unknown or if
        that ``config.json`` is invalid."""
        if is_local_path(name) or "/" in name:
            path = local_model_name(name)
            found = self._path_index.get(path)
            if found is not None:
                return self.models[found]
            local = self._local_model(path)
            if local is not None:
                return local
        found = self._model_index.get(_model_norm(name))
        if found is None:
            raise CatalogError(
                f"unknown model {name!r} (known: {', '.join(sorted(self.models))}; "
                "add your own with a catalog file, a config.json or a model directory)"
            )
        return self.models[found]

    def _local_model(self, path: str) -> ModelSpec | None:
        """The entry derived from the config.json at ``path``, read once (None: no file)."""
        if path not in self._local:
            found = hf_config.locate(path) is not None
            self._local[path] = self._unclaimed(hf_config.model_spec(path)) if found else None
        return self._local[path]

    def with_model(self, spec: ModelSpec) -> Catalog:
        """This catalog with ``spec`` added, replacing an entry of the same name. Aliases that
        another entry claims are dropped: ``spec`` keeps its name, the other entry its alias."""
        models = {name: m for name, m in self.models.items() if name != spec.name}
        others = self if len(models) == len(self.models) else Catalog(self.gpus, models)
        models[spec.name] = others._unclaimed(spec)
        return Catalog(self.gpus, models)

    def _unclaimed(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` without the aliases an entry of this catalog already claims."""
        kept = tuple(alias for alias in spec.aliases if self._owner(alias) is None)
        return spec if kept == spec.aliases else replace(spec, aliases=kept)

    def _owner(self, name: str) -> str | None:
        """The entry that claims ``name`` as its name or an alias (no files read)."""
        key = _path_key(name)
        if key is not None:
            return self._path_index.get(key)
        return self._model_index.get(_model_norm(name))

    def merged(self, text: str, origin: str) -> Catalog:
        """This catalog with the entries of one TOML document merged in (module docstring)."""
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise CatalogError(f"{origin}: not valid TOML: {exc}") from None
        unknown = sorted(set(doc) - {"gpus", "models"})
        if unknown:
            raise CatalogError(
                f"{origin}: unknown top-level key {unknown[0]!r} (expected [gpus.NAME] and "
                "[models.NAME] tables)"
            )
        gpus = dict(self.gpus)
        models = dict(self.models)
        for section, target, schema in (
            ("gpus", gpus, _GPU_FIELDS),
            ("models", models, _MODEL_FIELDS),
        ):
            tables = doc.get(section, {})
            if not isinstance(tables, dict):
                raise CatalogError(f"{origin}: {section} must be tables like [{section}.NAME]")
            for name, table in tables.items():
                where = f"{origin}: [{section}.{name!r}]"
                old = target.get(name)
                base = None if old is None else _as_fields(old)
                values = _parse_table(where, table, schema, base)
                if section == "gpus":
                    gpus[name] = _gpu_from(name, values)
                else:
                    models[name] = _model_from(name, where, values)
        try:
            return Catalog(gpus, models)
        except CatalogError as exc:
            raise CatalogError(f"{origin}: {exc}") from None


def _as_fields(spec: GpuSpec | ModelSpec) -> dict[str, object]:
    return {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "name"}


def _index(
    entries: Iterable[GpuSpec | ModelSpec], norm: Callable[[str], str | None], what: str
) -> dict[str, str]:
    """Key (``norm`` of a name or alias; None: not in this index) to entry name."""
    index: dict[str, str] = {}
    for entry in entries:
        for name in (entry.name, *entry.aliases):
            key = norm(name)
            if key is None:
                continue
            other = index.get(key)
            if other is not None and other != entry.name:
                raise CatalogError(
                    f"{what} name {name!r} is claimed by both {other!r} and {entry.name!r}"
                )
            index[key] = entry.name
    return index


@cache
def builtin_catalog() -> Catalog:
    """The catalogs shipped in scheduler/data."""
    catalog = Catalog({}, {})
    data = resources.files("scheduler") / "data"
    for filename in ("gpus.toml", "models.toml"):
        catalog = catalog.merged((data / filename).read_text(encoding="utf-8"), filename)
    return catalog


def _is_dir(path: str | Path) -> bool:
    try:
        return Path(path).expanduser().is_dir()
    except OSError:  # not one we can look into: read as a file, whose error names it
        return False


def load_catalog(extra: Iterable[str | Path] = ()) -> Catalog:
    """The built-in catalog with each path of ``extra`` merged in, in order: a TOML catalog
    file, or a Hugging Face ``config.json`` (any ``*.json``) or model directory holding one
    (``scheduler.hf_config``; added with ``Catalog.with_model``)."""
    catalog = builtin_catalog()
    for path in extra:
        if _is_dir(path) or Path(path).suffix.lower() == ".json":
            spec = hf_config.model_spec(path)
            try:
                catalog = catalog.with_model(spec)
            except CatalogError as exc:
                raise CatalogError(f"{path}: {exc}") from None
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise CatalogError(f"{path}: cannot read catalog file: {exc.strerror}") from None
        catalog = catalog.merged(text, str(path))
    return catalog
