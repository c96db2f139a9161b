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

Parts
-----
This module is the file's face: ``parse``, ``load``, ``from_canonical`` and the engine template
a model's jobs render (``engine_template``); the names the rest of fabric imports from here
(the spec, its renderers, the format's constants) are defined in its parts and re-exported:

* ``servicespec``    the spec (``ServiceSpec``, ``ModelService``, ``Limits``), the format's keys
  and bounds, the canonical bytes, JSON and the renderer back to TOML (pure, in
  ``elastic-pure``: ``vocab`` imports it);
* ``servicevalues``  one check per kind of value;
* ``servicecheck``   ``Checker``: a document into a spec, or every problem with its line;
* ``tomllines``      the line of every key (below).

Line numbers
------------
tomllib gives none: once tomllib has accepted a document, ``tomllines`` scans it for the line
of every table header, key and array element, and a problem takes the line of the longest
recorded prefix of its path (a missing key points at its table's header). Syntax errors take
the line in tomllib's message.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

from scheduler.catalog import Catalog, builtin_catalog

from fabricnode.elastic.servicecheck import Checker
from fabricnode.elastic.servicespec import AUTO as AUTO
from fabricnode.elastic.servicespec import DOMAIN as DOMAIN
from fabricnode.elastic.servicespec import ENGINE_SHORTHANDS as ENGINE_SHORTHANDS
from fabricnode.elastic.servicespec import FORMAT_VERSION as FORMAT_VERSION
from fabricnode.elastic.servicespec import LIMIT_KEYS, MAX_CANONICAL_BYTES, ROW_EXTENSIONS, ROW_KEYS
from fabricnode.elastic.servicespec import MODEL_KEYS as MODEL_KEYS
from fabricnode.elastic.servicespec import Limits as Limits
from fabricnode.elastic.servicespec import ModelService as ModelService
from fabricnode.elastic.servicespec import ServiceSpec as ServiceSpec
from fabricnode.elastic.servicespec import format_duration as format_duration
from fabricnode.elastic.servicespec import format_time_limit as format_time_limit
from fabricnode.elastic.servicespec import join_command as join_command
from fabricnode.elastic.tomllines import Locator, locate
from fabricnode.engine.template import EngineTemplate
from fabricnode.errors import DecodeError, FileProblem, ServiceFileError
from fabricnode.mesh import codec

# -- reading -----------------------------------------------------------------------------------


def parse(text: str, origin: str = "<service file>", catalog: Catalog | None = None) -> ServiceSpec:
    """The spec of a service file's text; ``ServiceFileError`` listing every problem if it
    is not valid. ``origin`` names the file in errors; GPU types are checked against
    ``catalog`` (default: the built-in one)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ServiceFileError(origin, [_syntax_problem(origin, text, exc)]) from None
    return Checker(origin, locate(text), catalog or builtin_catalog()).spec(doc)


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
        spec = Checker("<canonical>", Locator(""), catalog or builtin_catalog()).spec(doc)
    except ServiceFileError as exc:
        raise DecodeError(f"service spec: {exc}") from None
    if spec.canonical() != data:
        raise DecodeError("service spec: not in canonical form")
    return spec


_DURATION_KEYS = ("ttft_p95", "idle_to_zero", "hold_requests", "sleep_after", "scale_in_hold")


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


def engine_template(model: ModelService) -> EngineTemplate:
    """The engine template a node renders for ``model`` (with its ``{model_path}``): what the
    job's agent makes of the ``--engine-template`` and ``--model-path`` that
    ``slurmctl.SlurmControl`` passes it."""
    words = () if model.simulated else tuple(shlex.split(model.engine))
    paths = {model.name: model.model_path} if model.model_path is not None else {}
    return EngineTemplate(words, paths)


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
