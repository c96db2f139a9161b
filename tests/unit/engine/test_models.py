"""An engine's model list, read into what its entry may say (pure): vLLM's adapters with their
parents, the registry's limits (count, name length, entry bytes) with a reason for every model
left out, and the parents label every peer decodes."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from fabricnode.engine.models import (
    ENTRY_HEADROOM_BYTES,
    Listing,
    ServedModel,
    publishable,
    read_listing,
    room_for_models,
)
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.registry import (
    MAX_ENTRY_BYTES,
    MAX_MODEL_ID,
    MAX_MODELS,
    ModelInfo,
    SignedEntry,
)
from fabricnode.mesh.schema import ENGINE_ERROR_LABEL, PARENTS_LABEL, model_parents
from fabricnode.testing.simnet import make_body

ROOM = 10_000

# vLLM 0.32 (CPU) with --enable-lora, after /v1/load_lora_adapter (fields it adds trimmed)
VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny-llama", "object": "model", "owned_by": "vllm", "root": "/m/tiny",
         "parent": None, "max_model_len": 512},
        {"id": "tiny-lora", "object": "model", "owned_by": "vllm", "root": "/m/lora-a",
         "parent": "tiny-llama", "max_model_len": None},
    ],
}  # fmt: skip


def listing(*models: ServedModel, malformed: int = 0) -> Listing:
    return Listing(tuple(models), malformed)


def test_vllm_adapters_are_read_with_their_parent() -> None:
    got = read_listing(VLLM_MODELS)
    assert got == listing(
        ServedModel("tiny-llama", 512), ServedModel("tiny-lora", None, "tiny-llama")
    )
    pub = publishable(got, quantization=None, room_bytes=ROOM)
    assert pub.models == (ModelInfo("tiny-llama", 512), ModelInfo("tiny-lora", None))
    assert pub.labels == ((PARENTS_LABEL, ",0"),)
    assert pub.dropped == {}


def test_a_list_without_adapters_adds_no_label() -> None:
    pub = publishable(
        listing(ServedModel("a", 1), ServedModel("b", 2)), quantization="fp8", room_bytes=ROOM
    )
    assert pub.models == (ModelInfo("a", 1, "fp8"), ModelInfo("b", 2, "fp8"))
    assert pub.labels == ()


def test_items_that_are_not_models_are_counted_as_malformed() -> None:
    doc = {"data": [{"id": "a"}, {"id": ""}, {"nope": 1}, "x", {"id": 3}, {"id": "b", "parent": 7}]}
    got = read_listing(doc)
    assert got == listing(ServedModel("a", None), ServedModel("b", None), malformed=4)
    assert publishable(got, quantization=None, room_bytes=ROOM).dropped == {"malformed": 4}
    assert read_listing({"data": "x"}) == listing()
    assert read_listing([]) == listing()
    # a length that is no length is dropped, not the model
    assert read_listing({"data": [{"id": "a", "max_model_len": True}]}) == listing(
        ServedModel("a", None)
    )


def test_names_the_registry_cannot_carry_are_dropped_whole_with_a_reason() -> None:
    long_name = "x" * (MAX_MODEL_ID + 1)
    got = listing(
        ServedModel("base", 1),
        ServedModel(long_name, None, "base"),  # cut, it would route requests for it nowhere
        ServedModel("bad\nname", None, "base"),
        ServedModel("bad\x85nel", None, "base"),  # C1 controls, U+2028: not by ASCII alone
        ServedModel("bad\u2028line", None, "base"),
        ServedModel("bad\x9b2Jcsi", None, "base"),
        ServedModel("base", 2),
        ServedModel("ok" * 128, None, "base"),  # exactly MAX_MODEL_ID
    )
    pub = publishable(got, quantization=None, room_bytes=ROOM)
    assert [m.id for m in pub.models] == ["base", "ok" * 128]
    assert pub.dropped == {"name_too_long": 1, "bad_name": 4, "duplicate": 1}


def test_past_max_models_the_adapters_go_first_and_the_order_stays_the_engines() -> None:
    adapters = [ServedModel(f"lora-{i}", None, "base") for i in range(MAX_MODELS + 5)]
    got = listing(adapters[0], ServedModel("base", 512), *adapters[1:])
    pub = publishable(got, quantization=None, room_bytes=1 << 20)
    assert len(pub.models) == MAX_MODELS
    assert [m.id for m in pub.models[:3]] == ["lora-0", "base", "lora-1"]  # the engine's order
    assert "base" in {m.id for m in pub.models}
    assert pub.dropped == {"too_many": 6}
    parents = pub.labels[0][1].split(",")
    assert parents[0] == "1" and parents[1] == "" and set(parents[2:]) == {"1"}
    assert len(pub.labels[0][1]) <= 191


def test_models_past_the_room_in_the_entry_are_dropped_as_entry_full() -> None:
    got = listing(
        ServedModel("base", 512),
        *(ServedModel("l" * 200 + str(i), None, "base") for i in range(10)),
    )
    pub = publishable(got, quantization=None, room_bytes=1000)
    assert 1 <= len(pub.models) < 11 and pub.models[0].id == "base"
    assert pub.dropped == {"entry_full": 11 - len(pub.models)}


def test_a_parent_the_entry_does_not_list_is_not_said() -> None:
    pub = publishable(
        listing(ServedModel("lora", None, "elsewhere")), quantization=None, room_bytes=ROOM
    )
    assert pub.models == (ModelInfo("lora", None),) and pub.labels == ()


def test_the_largest_list_the_limits_allow_fits_a_signed_entry_with_room_for_a_down_label() -> None:
    me = Identity.from_seed(b"lora-node")
    body = make_body(me, "10.0.0.1:7946", time.time())
    names = [ServedModel("b" * MAX_MODEL_ID, 1 << 40)] + [
        ServedModel(f"{i:02d}" + "a" * (MAX_MODEL_ID - 2), None, "b" * MAX_MODEL_ID)
        for i in range(MAX_MODELS + 10)
    ]
    room = room_for_models(body)
    pub = publishable(listing(*names), quantization="q" * 64, room_bytes=room)
    assert pub.dropped and set(pub.dropped) <= {"entry_full", "too_many"}
    signed = body.successor(models=pub.models, labels=pub.labels).sign(me)
    # what is left is at least the headroom the engine's error label and the rest need
    assert len(signed.signed_bytes) <= MAX_ENTRY_BYTES - ENTRY_HEADROOM_BYTES + 64
    error = (ENGINE_ERROR_LABEL, "e" * 256)
    body.successor(models=pub.models, labels=(*pub.labels, error)).sign(me)  # no ValueError
    again = SignedEntry.from_wire(signed.to_wire())
    assert model_parents(again.body) == {m.id: "b" * MAX_MODEL_ID for m in pub.models[1:]}


@given(
    st.lists(
        st.builds(
            ServedModel,
            st.text(min_size=1, max_size=300),
            st.one_of(st.none(), st.integers(1, 1 << 40)),
            st.one_of(st.none(), st.text(min_size=1, max_size=20)),
        ),
        max_size=90,
    ),
    st.integers(0, 20_000),
)
def test_whatever_an_engine_lists_the_result_is_within_the_limits(
    models: list[ServedModel], room: int
) -> None:
    pub = publishable(listing(*models), quantization=None, room_bytes=room)
    ids = [m.id for m in pub.models]
    assert len(ids) == len(set(ids)) <= MAX_MODELS
    assert all(0 < len(i) <= MAX_MODEL_ID for i in ids)
    assert len(pub.models) + sum(pub.dropped.values()) == len(models)
    for _, value in pub.labels:
        assert len(value) <= 191
