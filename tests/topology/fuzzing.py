"""Hypothesis fuzzing shared by the tool-output parser tests.

Each parser test module names its fixture texts and an alphabet of the characters its tool
prints, then decorates its own checks: ``@fuzz_arbitrary_text(ALPHABET)`` feeds arbitrary
text, ``@fuzz_mutated_fixtures(ALL_TEXTS, ALPHABET)`` feeds fixtures after a few random
deletions, insertions, replacements, truncations and duplications.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MUTATIONS = ["delete", "insert", "replace", "truncate", "duplicate"]
Check = Callable[[str], None]


@st.composite
def mutated_fixture(draw: st.DrawFn, texts: Sequence[str], alphabet: st.SearchStrategy[str]) -> str:
    """One of ``texts`` after one to four random edits."""
    text = draw(st.sampled_from(texts))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 30)))
        op = draw(st.sampled_from(MUTATIONS))
        if op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + draw(st.text(alphabet, max_size=20)) + text[i:]
        elif op == "replace":
            text = text[:i] + draw(st.text(max_size=10)) + text[j:]
        elif op == "truncate":
            text = text[:i]
        else:
            text = text[:j] + text[i:j] + text[j:]
    return text


def fuzz_arbitrary_text(alphabet: st.SearchStrategy[str]) -> Callable[[Check], Any]:
    """Run the check on arbitrary text and on text drawn from the tool's own alphabet."""

    def decorate(check: Check) -> Any:
        return settings(
            max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        )(given(st.text(max_size=300) | st.text(alphabet, max_size=300))(check))

    return decorate


def fuzz_mutated_fixtures(
    texts: Sequence[str], alphabet: st.SearchStrategy[str]
) -> Callable[[Check], Any]:
    """Run the check on randomly edited fixture texts."""

    def decorate(check: Check) -> Any:
        return settings(
            max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        )(given(mutated_fixture(texts, alphabet))(check))

    return decorate
