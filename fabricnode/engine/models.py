"""What an engine serves, read into what its entry may say (pure: no I/O, no clock).

The engine's ``GET /v1/models`` is read when it comes up and again every few seconds while it
serves (``service.EngineService``), so models that come and go at runtime — LoRA adapters
loaded with vLLM's ``/v1/load_lora_adapter`` and removed with ``/v1/unload_lora_adapter`` —
reach the node's signed entry, and with it every ingress's ``/v1/models`` and routes. vLLM
lists an adapter as a model whose ``parent`` is its base model.

What an engine lists is untrusted input for a bounded entry (``fabricnode.mesh.registry``:
at most ``MAX_MODELS`` models, ids of at most ``MAX_MODEL_ID`` characters, ``MAX_ENTRY_BYTES``
signed bytes in all). ``publishable`` keeps what fits and says what it dropped, by reason:

* ``malformed``     not an object with a non-empty string ``id``;
* ``name_too_long`` an id longer than the registry takes (cutting it would route requests for
                    the full name nowhere);
* ``bad_name``      an id with a character that is not printable by its Unicode category
                    (``str.isprintable``: C0 and C1 controls, format characters, line and
                    paragraph separators): peers refuse such an id (``registry``);
* ``duplicate``     an id listed before;
* ``too_many``      past ``MAX_MODELS``;
* ``entry_full``    past the room left in the entry (``room_for_models``).

Base models are kept before adapters, each in the engine's order, and the kept ones are
published in the engine's order. Which model is an adapter of which rides in the entry's
``fabric.parents`` label (``schema.parents_labels``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from fabricnode.mesh.registry import MAX_ENTRY_BYTES, MAX_MODEL_ID, MAX_MODELS, EntryBody, ModelInfo
from fabricnode.mesh.schema import PARENTS_LABEL, parents_labels

# A model list larger than this is not read (vLLM's, with 64 adapters, is about 40 KB).
MAX_LISTING_BYTES = 1 << 20
# Left free in the entry for what is set after the models: the engine's error when it goes
# DOWN (a 256-character label), ``fabric.sleeping``, lease and version growth.
ENTRY_HEADROOM_BYTES = 1024
# What the parents label can take: its key, at most 191 characters of value, msgpack framing.
PARENTS_LABEL_BYTES = len(PARENTS_LABEL) + 191 + 8
DROP_REASONS = ("malformed", "name_too_long", "bad_name", "duplicate", "too_many", "entry_full")


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_model_len: int | None
    parent: str | None = None  # the base model, for an adapter (vLLM's ``parent``)


@dataclass(frozen=True)
class Listing:
    """An engine's ``/v1/models`` answer, read leniently."""

    models: tuple[ServedModel, ...]
    malformed: int  # items that are not a model


@dataclass(frozen=True)
class Publishable:
    """What the entry says about the engine's models."""

    models: tuple[ModelInfo, ...]
    labels: tuple[tuple[str, str], ...]  # the ``fabric.parents`` label, or none
    dropped: dict[str, int]  # reason -> models left out of ``models`` (reasons with any)


def read_listing(doc: Any) -> Listing:
    """Models from an OpenAI ``/v1/models`` answer (vLLM adds ``max_model_len`` and, for an
    adapter, ``parent``); items that are not a model are counted, not raised."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return Listing((), 0)
    out: list[ServedModel] = []
    malformed = 0
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"]:
            malformed += 1
            continue
        mlen = item.get("max_model_len")
        ok_len = isinstance(mlen, int) and not isinstance(mlen, bool) and 0 < mlen <= 2**40
        parent = item.get("parent")
        out.append(
            ServedModel(
                item["id"],
                mlen if ok_len else None,
                parent if isinstance(parent, str) and parent else None,
            )
        )
    return Listing(tuple(out), malformed)


def parse_models(doc: Any) -> list[ServedModel]:
    """The models of an OpenAI ``/v1/models`` answer (``read_listing`` without the count)."""
    return list(read_listing(doc).models)


def room_for_models(body: EntryBody) -> int:
    """Bytes the models may take in ``body``'s signed form, leaving ``ENTRY_HEADROOM_BYTES``
    for what is set later (the parents label is counted as part of the models)."""
    bare = replace(
        body,
        models=(),
        labels=tuple((k, v) for k, v in body.labels if k != PARENTS_LABEL),
    )
    return MAX_ENTRY_BYTES - len(bare.canonical_bytes()) - ENTRY_HEADROOM_BYTES


def row_bytes(model: ModelInfo) -> int:
    """An upper bound of the model's row in the signed entry (msgpack: an array of the id,
    the length as up to a 64-bit int, the quantization)."""
    quant = model.quantization
    return 1 + 3 + len(model.id.encode()) + 9 + (1 if quant is None else 3 + len(quant.encode()))


def publishable(
    listing: Listing,
    *,
    quantization: str | None,
    room_bytes: int,
    max_models: int = MAX_MODELS,
) -> Publishable:
    """The models of ``listing`` that the entry can carry in ``room_bytes``, and why the others
    were left out."""
    dropped: Counter[str] = Counter()
    if listing.malformed:
        dropped["malformed"] = listing.malformed
    seen: set[str] = set()
    valid: list[ServedModel] = []
    for m in listing.models:
        if len(m.id) > MAX_MODEL_ID:
            dropped["name_too_long"] += 1
        elif not m.id.isprintable():
            dropped["bad_name"] += 1
        elif m.id in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(m.id)
            valid.append(m)
    if any(m.parent is not None and m.parent in seen for m in valid):
        room_bytes -= PARENTS_LABEL_BYTES
    bases = [m for m in valid if m.parent is None]
    adapters = [m for m in valid if m.parent is not None]
    kept: set[str] = set()
    used = 0
    for m in bases + adapters:
        size = row_bytes(ModelInfo(m.id, m.max_model_len, quantization))
        if len(kept) >= max_models:
            dropped["too_many"] += 1
        elif used + size > room_bytes:
            dropped["entry_full"] += 1
        else:
            kept.add(m.id)
            used += size
    chosen = [m for m in valid if m.id in kept]
    models = tuple(ModelInfo(m.id, m.max_model_len, quantization) for m in chosen)
    parents = {m.id: m.parent for m in chosen if m.parent is not None}
    return Publishable(models, parents_labels(models, parents), dict(dropped))
