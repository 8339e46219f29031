"""Admission: a request that can never be served is rejected with a reason, once."""

from __future__ import annotations

import pytest

from topkv.policy import Admission, AdmissionLimits, PolicyInputError, admit
from topkv.policy.admission import KV_EXCEEDS_DECODE_MEMORY, LONGER_THAN_CONTEXT


def test_fits_is_admitted() -> None:
    limits = AdmissionLimits(max_context_tokens=8192, max_decode_kv=1e9)
    assert admit(8192, 1e9, limits) == Admission(True)


def test_longer_than_context_is_rejected_first() -> None:
    limits = AdmissionLimits(max_context_tokens=8192, max_decode_kv=1e9)
    verdict = admit(8193, 2e9, limits)  # both too long and too large: context reported
    assert not verdict.admitted
    assert verdict.reason == LONGER_THAN_CONTEXT
    assert "8193" in verdict.detail and "8192" in verdict.detail


def test_kv_larger_than_every_decode_instance_is_rejected() -> None:
    limits = AdmissionLimits.of(None, [4e9, 8e9, 6e9])
    assert limits.max_decode_kv == 8e9
    assert admit(10**8, 8e9, limits).admitted
    verdict = admit(10**8, 8e9 + 1, limits)
    assert (verdict.admitted, verdict.reason) == (False, KV_EXCEEDS_DECODE_MEMORY)


def test_unknown_context_admits_any_length_and_no_decoders_admit_nothing() -> None:
    assert admit(10**9, 1.0, AdmissionLimits(None, 1.0)).admitted
    assert admit(1, 1.0, AdmissionLimits.of(None, [])).reason == KV_EXCEEDS_DECODE_MEMORY


@pytest.mark.parametrize(("context", "kv"), [(0, 1.0), (-5, 1.0), (None, -1.0)])
def test_bad_limits_are_refused(context: int | None, kv: float) -> None:
    with pytest.raises(PolicyInputError):
        AdmissionLimits(context, kv)


def test_nan_capacity_is_refused() -> None:
    with pytest.raises(PolicyInputError):
        AdmissionLimits(None, float("nan"))
