"""The engine command a JOIN-only node runs when an operator assigns it a model.

``fabric start --engine-template 'vllm serve {model_path} --served-model-name {model}
--tensor-parallel-size {tp} --port {port}'`` starts an agent without an engine; when a trusted
``fabric plan --apply`` assigns it a model, the template is rendered and supervised exactly like
an engine command given after ``--``.

The template is split like a shell line once, at start-up (so a bad template fails then, not
when the assignment arrives); each word is then formatted on its own, so a substituted path
with spaces stays one argument. Placeholders:

    {model}       the assigned model id (as in the workload file / catalog)
    {model_path}  what ``--model-path MODEL=PATH`` maps it to (default: the model id)
    {tp} {dp}     tensor- and data-parallel degree; {gpus} = tp * dp
    {port}        a free loopback port for the engine (required: the agent connects there)
    {host}        127.0.0.1

``sim`` is a shorthand for the built-in simulated engine on the node's (simulated) GPU type.
"""

from __future__ import annotations

import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fabricnode.engine.command import (
    EngineCommand,
    free_port,
    inspect_engine_cmd,
    sim_engine_command,
)
from fabricnode.errors import ConfigError

PLACEHOLDERS = frozenset({"model", "model_path", "tp", "dp", "gpus", "port", "host"})
SIM = "sim"
ENGINE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class EngineTemplate:
    words: tuple[str, ...]  # () for the simulated engine
    model_paths: Mapping[str, str] = field(default_factory=dict)

    @property
    def simulated(self) -> bool:
        return not self.words

    def describe(self) -> str:
        return SIM if self.simulated else shlex.join(self.words)

    def render(self, model: str, tp: int, dp: int, gpu_type: str = "") -> EngineCommand:
        """The command for one assignment, on a free loopback port."""
        if self.simulated:
            return _sim_command(model, gpu_type)
        port = free_port()
        values = {
            "model": model,
            "model_path": self.model_paths.get(model, model),
            "tp": str(tp),
            "dp": str(dp),
            "gpus": str(tp * dp),
            "port": str(port),
            "host": ENGINE_HOST,
        }
        argv = [word.format_map(values) for word in self.words]
        return inspect_engine_cmd(argv, f"http://{ENGINE_HOST}:{port}")


def parse_template(text: str, model_paths: Sequence[str] = ()) -> EngineTemplate:
    """``--engine-template`` and ``--model-path MODEL=PATH`` options; ConfigError if wrong."""
    paths = _model_paths(model_paths)
    text = text.strip()
    if text == SIM:
        return EngineTemplate((), paths)
    try:
        words = template_words(text)
    except ConfigError as exc:
        raise ConfigError(f"--engine-template: {exc}") from None
    return EngineTemplate(words, paths)


def template_words(text: str) -> tuple[str, ...]:
    """The words of an engine command template (not ``sim``), each checked: known placeholders
    only, ``{port}`` and ``{model}`` or ``{model_path}`` used. ConfigError (naming no option,
    for the caller to prefix) if not."""
    try:
        words = tuple(shlex.split(text))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not words:
        raise ConfigError("empty command")
    used: set[str] = set()
    for word in words:
        try:
            fields = list(string.Formatter().parse(word))
        except ValueError as exc:
            raise ConfigError(f"word {word!r}: {exc}") from None
        for _, name, spec, conversion in fields:
            if name is None:
                continue
            if name not in PLACEHOLDERS or spec or conversion:
                known = ", ".join("{" + p + "}" for p in sorted(PLACEHOLDERS))
                raise ConfigError(
                    f"unknown placeholder {{{name}}} in {word!r} "
                    f"(known: {known}; write {{{{ and }}}} for literal braces)"
                )
            used.add(name)
    if "port" not in used:
        raise ConfigError(
            "must pass {port} to the engine (e.g. --port {port}): the agent picks a free port "
            "and connects to the engine there"
        )
    if "model" not in used and "model_path" not in used:
        raise ConfigError("must name the model: use {model} or {model_path}")
    return words


def _model_paths(specs: Sequence[str]) -> dict[str, str]:
    paths: dict[str, str] = {}
    for spec in specs:
        model, sep, path = spec.partition("=")
        if not sep or not model.strip() or not path.strip():
            raise ConfigError(f"--model-path {spec!r}: expected MODEL=PATH")
        paths[model.strip()] = path.strip()
    return paths


def _sim_command(model: str, gpu_type: str) -> EngineCommand:
    from fabricnode.simengine.model import GPU_PROFILES

    known = {name.lower(): name for name in GPU_PROFILES}
    profile = known.get(gpu_type.lower(), "H100")  # a type it cannot simulate: the default one
    return sim_engine_command(model, profile)
