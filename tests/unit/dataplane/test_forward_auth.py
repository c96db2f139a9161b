"""Forward headers: what verifies, and that everything else is a ``ForwardRejected``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.dataplane.forward_auth import ForwardRejected, ForwardVerifier, sign_forward
from fabricnode.mesh.keyring import Keyring

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
SENDER = "a" * 32
TARGET = "b" * 32
METHOD = b"POST"
PATH = b"/v1/chat/completions"
BODY = b'{"model":"m1","messages":[]}'
NOW = 1_750_000_000.0
SKEW = 30.0


def sign(
    *,
    keyring: Keyring | None = None,
    sender: str = SENDER,
    target: str = TARGET,
    method: bytes = METHOD,
    path: bytes = PATH,
    body: bytes = BODY,
    now: float = NOW,
    sites: bytes | None = None,
) -> bytes:
    return sign_forward(
        keyring or Keyring.with_key(KEY),
        sender=sender,
        target=target,
        method=method,
        path=path,
        body=body,
        now=now,
        sites=sites,
    )


def verifier(*keys: bytes) -> ForwardVerifier:
    ring = Keyring()
    for key in keys or (KEY,):
        ring.add(key)
    return ForwardVerifier(ring, max_skew_s=SKEW)


def verify(
    v: ForwardVerifier,
    value: bytes,
    *,
    own_session: str = TARGET,
    method: bytes = METHOD,
    path: bytes = PATH,
    body: bytes = BODY,
    now: float = NOW,
    sites: bytes | None = None,
) -> str:
    return v.verify(
        value,
        own_session=own_session,
        method=method,
        path=path,
        body=body,
        now=now,
        sites=sites,
    )


def test_a_signed_forward_verifies_and_names_its_sender() -> None:
    v = verifier()
    assert verify(v, sign()) == SENDER
    assert v.rejected == 0


def test_the_header_has_the_documented_fields() -> None:
    version, kid, ms, nonce, sender, mac = sign().split(b" ")
    assert (version, kid, ms, sender) == (
        b"1",
        Keyring.with_key(KEY).primary.hex().encode(),
        b"%d" % (NOW * 1000),
        SENDER.encode(),
    )
    assert len(bytes.fromhex(nonce.decode())) == 8
    assert len(bytes.fromhex(mac.decode())) == 32


def test_each_signature_has_a_fresh_nonce_so_a_retry_is_not_a_replay() -> None:
    v = verifier()
    first, second = sign(), sign()
    assert first != second
    assert verify(v, first) == verify(v, second) == SENDER


@pytest.mark.parametrize(
    "changed",
    [
        {"method": b"GET"},
        {"path": b"/v1/completions"},
        {"body": BODY + b" "},
        {"body": b""},
        {"own_session": "c" * 32},  # captured on the way to one node, replayed to another
    ],
    ids=lambda changed: next(iter(changed)),
)
def test_a_forward_does_not_verify_for_another_request(changed: dict[str, object]) -> None:
    v = verifier()
    with pytest.raises(ForwardRejected, match="does not verify"):
        verify(v, sign(), **changed)  # type: ignore[arg-type]
    assert v.rejected == 1


def test_a_forward_with_another_version_is_rejected() -> None:
    parts = sign().split(b" ")
    parts[0] = b"2"
    with pytest.raises(ForwardRejected, match="malformed"):
        verify(verifier(), b" ".join(parts))


def test_a_forward_with_a_changed_sender_does_not_verify() -> None:
    parts = sign().split(b" ")
    parts[4] = b"c" * 32
    with pytest.raises(ForwardRejected, match="does not verify"):
        verify(verifier(), b" ".join(parts))


@pytest.mark.parametrize("field", [2, 3, 5], ids=["time", "nonce", "mac"])
def test_a_forward_with_a_changed_field_does_not_verify(field: int) -> None:
    parts = sign().split(b" ")
    flipped = b"1" if parts[field][-1:] != b"1" else b"2"
    parts[field] = parts[field][:-1] + flipped
    with pytest.raises(ForwardRejected):
        verify(verifier(), b" ".join(parts))


def test_a_forward_signed_with_a_key_outside_the_keyring_is_rejected() -> None:
    header = sign(keyring=Keyring.with_key(OTHER_KEY))
    with pytest.raises(ForwardRejected, match="not in this agent's keyring"):
        verify(verifier(KEY), header)


def test_a_forward_whose_key_id_names_another_key_does_not_verify() -> None:
    """The MAC, not the key id, proves the key: a header relabelled to our key id fails."""
    parts = sign(keyring=Keyring.with_key(OTHER_KEY)).split(b" ")
    parts[1] = Keyring.with_key(KEY).primary.hex().encode()
    with pytest.raises(ForwardRejected, match="does not verify"):
        verify(verifier(KEY), b" ".join(parts))


def test_during_a_rotation_forwards_signed_with_either_key_verify() -> None:
    v = verifier(KEY, OTHER_KEY)
    assert verify(v, sign(keyring=Keyring.with_key(KEY))) == SENDER
    assert verify(v, sign(keyring=Keyring.with_key(OTHER_KEY))) == SENDER


@pytest.mark.parametrize("offset", [-SKEW, SKEW, -SKEW / 2, 0.0])
def test_a_forward_within_the_skew_window_verifies(offset: float) -> None:
    assert verify(verifier(), sign(now=NOW + offset)) == SENDER


@pytest.mark.parametrize("offset", [-SKEW - 0.01, SKEW + 0.01, -3600.0, 3600.0])
def test_a_forward_outside_the_skew_window_is_rejected(offset: float) -> None:
    """Too old (offset < 0: signed before now) or from the future (offset > 0)."""
    with pytest.raises(ForwardRejected, match="too old or from the future"):
        verify(verifier(), sign(now=NOW + offset))


def test_a_replayed_forward_is_rejected() -> None:
    v = verifier()
    header = sign()
    verify(v, header)
    with pytest.raises(ForwardRejected, match="replayed"):
        verify(v, header, now=NOW + 1)
    with pytest.raises(ForwardRejected, match="too old"):
        verify(v, header, now=NOW + SKEW + 1)  # past the window the clock rejects it first
    assert v.rejected == 2


def test_a_replay_is_caught_after_many_other_forwards_within_the_window() -> None:
    v = verifier()
    header = sign()
    verify(v, header)
    for i in range(200):
        verify(v, sign(now=NOW + i * 0.1), now=NOW + i * 0.1)
    with pytest.raises(ForwardRejected, match="replayed"):
        verify(v, header, now=NOW + 20)


def test_a_forward_rejected_for_its_mac_does_not_burn_the_genuine_one() -> None:
    v = verifier()
    header = sign()
    with pytest.raises(ForwardRejected):
        verify(v, header, body=b"other")
    assert verify(v, header) == SENDER


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"1",
        b"1 2 3 4 5",
        b"1 2 3 4 5 6 7",
        b"2 00000000 1750000000000 0011223344556677 " + SENDER.encode() + b" " + b"00" * 32,
        b"1 zz 1750000000000 00 a 00",
        b"1 00000000 17500000000x0 00 a 00",
        b"1 00000000 1750000000000 00 \xff\xfe 00",
        b"1 00000000 1750000000000 00 a 0g",
        b"1 00000000 " + b"9" * 400 + b" 00 a 00",
        b"1 00000000 -" + b"9" * 400 + b" 00 a 00",
        b"1 00000000 " + b"9" * 5000 + b" 00 a 00",
    ],
)
def test_a_malformed_header_is_rejected(value: bytes) -> None:
    v = verifier()
    with pytest.raises(ForwardRejected):
        verify(v, value)
    assert v.rejected == 1


@given(st.binary(max_size=300))
def test_arbitrary_bytes_are_rejected_with_forward_rejected(value: bytes) -> None:
    with pytest.raises(ForwardRejected):
        verify(verifier(), value)


_field = st.binary(max_size=40).filter(lambda b: b" " not in b)
_number = st.integers(-(10**600), 10**600).map(lambda i: b"%d" % i)


@given(
    field=st.integers(0, 5),
    replacement=_field | _number | st.from_regex(rb"\A[0-9a-fA-F]{0,80}\Z"),
)
def test_a_header_with_any_one_field_replaced_is_rejected_with_forward_rejected(
    field: int, replacement: bytes
) -> None:
    parts = sign().split(b" ")
    original = parts[field]
    parts[field] = replacement
    v = verifier()
    if replacement == original or (field == 5 and _same_hex(replacement, original)):
        assert verify(v, b" ".join(parts)) == SENDER  # the same header, or the MAC in capitals
        return
    with pytest.raises(ForwardRejected):
        verify(v, b" ".join(parts))
    assert v.rejected == 1


def _same_hex(a: bytes, b: bytes) -> bool:
    try:
        return bytes.fromhex(a.decode("ascii")) == bytes.fromhex(b.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return False


def test_the_sites_a_forward_carries_are_bound_to_its_mac() -> None:
    """Data residency: a forward's allowed sites cannot be widened, dropped or added on the
    way; a forward without them verifies as it always did."""
    assert verify(verifier(), sign(sites=b"A,B"), sites=b"A,B") == SENDER
    for carried in (None, b"A,B,C", b"A", b""):
        with pytest.raises(ForwardRejected, match="does not verify"):
            verify(verifier(), sign(sites=b"A,B"), sites=carried)
    with pytest.raises(ForwardRejected, match="does not verify"):
        verify(verifier(), sign(), sites=b"A")
    assert verify(verifier(), sign(sites=None), sites=None) == SENDER
