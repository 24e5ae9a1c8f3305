"""Manifest signing (pure): what verifies and what is refused, and why."""

from __future__ import annotations

import pytest

from modelship.errors import UsageError
from modelship.signing import generate_key, key_bytes, sign, signature_problem

KEY = generate_key().encode()
DOC = {"model": "fraud", "version": 3, "files": {"model.onnx": {"sha256": "ab" * 32,
                                                                "size": 10}}}


def test_a_signed_document_verifies_and_keeps_its_content() -> None:
    signed = sign(DOC, KEY)
    assert {k: v for k, v in signed.items() if k != "signature"} == DOC
    assert signature_problem(signed, KEY) is None
    assert sign(signed, KEY) == signed  # re-signing replaces, never nests
    reordered = dict(reversed(list(signed.items())))
    assert signature_problem(reordered, KEY) is None  # canonical form: key order is irrelevant


@pytest.mark.parametrize(("case", "change", "reason"), [
    ("unsigned", lambda d: {k: v for k, v in d.items() if k != "signature"}, "not signed"),
    ("file digest changed", lambda d: {**d, "files": {"model.onnx": {"sha256": "cd" * 32,
                                                                     "size": 10}}},
     "does not match its content"),
    ("version changed", lambda d: {**d, "version": 4}, "does not match its content"),
    ("field added", lambda d: {**d, "extra": 1}, "does not match its content"),
    ("other key", lambda d: sign(DOC, generate_key().encode()), "another key"),
    ("wrong algorithm", lambda d: {**d, "signature": {**d["signature"], "alg": "none"}},
     "not an hmac-sha256 signature"),
    ("signature not a mapping", lambda d: {**d, "signature": "x"}, "not an hmac-sha256"),
])
def test_tampering_is_refused_with_a_reason(case: str, change: object, reason: str) -> None:
    assert callable(change)
    problem = signature_problem(change(sign(DOC, KEY)), KEY)
    assert problem is not None and reason in problem, (case, problem)


@pytest.mark.parametrize("key", [None, "", "short"])
def test_a_missing_or_short_key_is_a_usage_error_naming_the_setting(key: str | None) -> None:
    with pytest.raises(UsageError, match="MODELSHIP_MANIFEST_SIGNING_KEY|at least 32") as info:
        key_bytes(key)
    assert "MODELSHIP_MANIFEST_SIGNING_KEY" in str(info.value)
    assert info.value.exit_code == 2


def test_key_bytes_accepts_secret_str() -> None:
    from pydantic import SecretStr

    assert key_bytes(SecretStr(KEY.decode())) == KEY
