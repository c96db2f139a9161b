"""The served model names: the base model and, with ``--enable-lora``, LoRA adapters, as vLLM
0.32 keeps them (``OpenAIServingModels``).

* ``--lora-modules name=path`` (or vLLM's JSON form ``{"name": ..., "path": ...}``) loads
  adapters at start; ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter {"lora_name"}`` change them at run time and answer 200 with
  vLLM's plain-text ``Success: ...`` line. (vLLM attaches these two routes only when
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set as well; here ``--enable-lora`` is enough.)
  Their errors are vLLM's: 400 ``InvalidUserInput`` (a name missing, the base model's name, a
  name already loaded without ``load_inplace``), 404 ``NotFoundError`` unloading an unknown one.
* ``GET /v1/models`` lists each adapter after the base model, as vLLM does: ``root`` its path,
  ``parent`` the base model, ``max_model_len`` null.
* A request naming an adapter is served by the base model's engine with the adapter's salt
  (``model.adapter_salt``): its text differs from the base model's, its KV blocks are its own,
  and answers name the adapter as their ``model``. Any other unknown name is 404.

Nothing is read from ``lora_path``: the simulated engine has no weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from fabricnode.errors import ConfigError
from fabricnode.simengine.httpio import HttpError, Json
from fabricnode.simengine.model import adapter_salt

# A bound on the adapters registered at once (vLLM has none; each costs the simulated engine
# a few hundred bytes, so this only keeps a loop of loads from growing it without end).
MAX_ADAPTERS = 4096


@dataclass(frozen=True)
class Served:
    """What a request's ``model`` resolved to."""

    name: str  # what the answer reports as its model
    salt: bytes = b""  # the adapter's (model.adapter_salt); empty for the base model
    adapter: str | None = None


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    int_id: int


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``name=path`` or ``{"name": ..., "path": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--lora-modules: invalid JSON {text!r}: {exc}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"--lora-modules: {text!r} is not a JSON object")
        name, path = doc.get("name"), doc.get("path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ConfigError(f"--lora-modules: {text!r} needs string 'name' and 'path'")
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules: expected NAME=PATH, got {text!r}")
    return name, path


class Models:
    """The base model and the LoRA adapters loaded now."""

    def __init__(
        self,
        base: str,
        max_model_len: int,
        *,
        enable_lora: bool = False,
        lora_modules: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.base = base
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        self._adapters: dict[str, Adapter] = {}
        self._next_int_id = 1
        for name, path in lora_modules:
            self._add(name, path)

    def adapters(self) -> list[Adapter]:
        return list(self._adapters.values())

    def _add(self, name: str, path: str) -> None:
        previous = self._adapters.get(name)
        if previous is None:
            if len(self._adapters) >= MAX_ADAPTERS:
                raise HttpError(
                    400,
                    f"too many LoRA adapters loaded (at most {MAX_ADAPTERS})",
                    400,
                    kind="InvalidUserInput",
                )
            int_id, self._next_int_id = self._next_int_id, self._next_int_id + 1
        else:
            int_id = previous.int_id
        self._adapters[name] = Adapter(name, path, int_id)

    def resolve(self, model: object) -> Served:
        """The model a request names; none names the base model, as in vLLM."""
        if model is None or model == "" or model == self.base:
            return Served(self.base)
        if not isinstance(model, str):
            raise HttpError(400, "'model' must be a string", "invalid_parameter", "model")
        if model in self._adapters:
            return Served(model, adapter_salt(model), model)
        raise HttpError(404, f"The model `{model}` does not exist.", "model_not_found", "model")

    def cards(self, created: int) -> list[Json]:
        base: Json = {
            "id": self.base,
            "object": "model",
            "created": created,
            "owned_by": "fabricnode-sim",
            "root": self.base,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        loras: list[Json] = [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "fabricnode-sim",
                "root": a.path,
                "parent": self.base,
                "max_model_len": None,
            }
            for a in self._adapters.values()
        ]
        return [base, *loras]

    # -- vLLM's runtime endpoints --

    def load(self, request: Json) -> str:
        name, path = request.get("lora_name"), request.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if request.get("load_inplace") is not True and name in self._adapters:
            raise _invalid(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        self._add(name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, request: Json) -> str:
        name = request.get("lora_name")
        if not isinstance(name, str) or not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in self._adapters:
            raise HttpError(
                404, f"The lora adapter '{name}' cannot be found.", 404, kind="NotFoundError"
            )
        del self._adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def _invalid(message: str) -> HttpError:
    return HttpError(400, message, 400, kind="InvalidUserInput")
