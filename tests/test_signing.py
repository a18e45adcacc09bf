"""What travels through the kernel's store is signed with a key the store never holds
(core/signing.py, issue 44): pure, milliseconds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from infini_notebook.core import signing

KEY = signing.new_key()


@given(st.binary(max_size=300))
def test_a_signed_message_verifies_under_its_own_name_only(body):
    raw = signing.sign(KEY, "infini/stdin/answer/0-ab", body)
    assert signing.verify(KEY, "infini/stdin/answer/0-ab", raw) == body
    assert signing.verify(KEY, "infini/stdin/answer/1-ab", raw) is None  # moved: refused
    assert signing.verify(signing.new_key(), "infini/stdin/answer/0-ab", raw) is None


@given(st.binary(min_size=1, max_size=100), st.integers(min_value=0))
def test_any_changed_byte_is_refused(body, where):
    raw = bytearray(signing.sign(KEY, "k", body))
    raw[where % len(raw)] ^= 0x01
    assert signing.verify(KEY, "k", bytes(raw)) is None


def test_what_an_attacker_can_write_is_refused():
    for forged in (b"", b'{"value": "EVIL"}', b"0" * 64 + b'{"value": "EVIL"}', "release 0"):
        assert signing.verify(KEY, "infini/stacks/0/ask/3", forged) is None


@given(st.text(max_size=200))
def test_a_sealed_secret_opens_with_the_key_and_shows_nothing_without_it(secret):
    sealed = signing.seal(KEY, "infini/stdin/answer/0-ab", secret)
    assert signing.unseal(KEY, "infini/stdin/answer/0-ab", sealed) == secret
    if len(secret.encode()) >= 4:
        assert secret.encode().hex() not in sealed
    assert sealed != signing.seal(KEY, "infini/stdin/answer/0-ab", secret)  # fresh nonce
