"""The tiny seeded MoE model really routes tokens; the recorder counts and times its experts."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import TINY
from topkv.engine import PrefillRunner, state_dict_digest
from topkv.engine.errors import UnsupportedModelError
from topkv.engine.models import build_demo_model
from topkv.engine.moe import ExpertRecorder, build_demo_moe_model, moe_shape

pytestmark = pytest.mark.model


def test_the_same_seed_gives_the_same_moe_model() -> None:
    a = build_demo_moe_model(TINY, 3)
    b = build_demo_moe_model(TINY, 3)
    c = build_demo_moe_model(TINY, 4)
    assert state_dict_digest(a) == state_dict_digest(b) != state_dict_digest(c)
    assert moe_shape(a) == (8, 2) and "mixtral" in a.model_id
    assert moe_shape(build_demo_model(TINY, 0)) is None
    with pytest.raises(UnsupportedModelError, match="top_k 9"):
        build_demo_moe_model(TINY, 0, experts=8, top_k=9)


def test_the_recorder_counts_every_routed_token_and_sees_slow_experts() -> None:
    now = [0.0]
    model = build_demo_moe_model(TINY, 0)
    recorder = ExpertRecorder(model, clock=lambda: now[0])
    prompt = list(range(1, 65))
    PrefillRunner(model).run(prompt, lambda *_: None)
    _, warm = recorder.stats()
    assert all(f.compute_s == 0 for f in warm)  # the first pass only warms up
    PrefillRunner(model).run(prompt, lambda *_: None)
    now[0] = 2.0
    seq, figures = recorder.stats()
    assert seq == 2 and len(figures) == 2 * 8
    for layer in (0, 1):
        routed = [f for f in figures if f.layer == layer]
        # 64 tokens x top-2 per layer and pass, spread over experts by the (seeded) router.
        assert sum(f.activations for f in routed) == 2 * 64 * 2
        assert len({f.activations for f in routed}) > 1
        used = [f for f in routed if f.activations]
        assert all(f.compute_s > 0 for f in used)
    # rate: the second pass's activations (half the total) / 2 s, through the EMA
    # (alpha 0.3) whose first step saw the first pass's over ~0 s (a huge rate) -- so
    # check the relation over a third window instead.
    PrefillRunner(model).run(prompt, lambda *_: None)
    before_rate = {(f.layer, f.expert): f.rate for f in figures}
    now[0] = 4.0
    _, third = recorder.stats()
    for f in third:
        window = f.activations / 3 / 2.0  # each pass routes the same tokens the same way
        assert f.rate == pytest.approx(0.7 * before_rate[(f.layer, f.expert)] + 0.3 * window)
    figures = third
    before = max(f.compute_s for f in figures)
    recorder.delay_s = 0.05  # the injected straggler: every expert block sleeps 50 ms
    for _ in range(4):
        PrefillRunner(model).run([5], lambda *_: None)
    _, slow = recorder.stats()
    assert max(f.compute_s for f in slow) > 2 * before
    # Dense models have nothing to record.
    with pytest.raises(UnsupportedModelError, match="no routed experts"):
        ExpertRecorder(build_demo_model(TINY, 0))
