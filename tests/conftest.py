import os

import pytest
from hypothesis import HealthCheck, settings

# Property tests stay bounded so CI is fast; HYPOTHESIS_PROFILE=thorough for more.
settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

import mlx.core as mx

# The CPU-kernel tests expect the CPU; on a Mac the Metal tests pass
# stream=mx.gpu explicitly (kernel_lab/metal_runner.py).
mx.set_default_device(mx.cpu)


@pytest.fixture
def always_draft(monkeypatch):
    """Drafts in every step: the timed back-off (StepCost, PlainStepCost)
    would skip them on a loaded machine, and these tests check the
    verification, not the back-off (tested on its own in test_speculative.py)."""
    from mlx_attn.lm.generate import PlainStepCost
    from mlx_attn.lm.speculative import StepCost

    monkeypatch.setattr(StepCost, "worth", lambda self, *args: True)
    monkeypatch.setattr(StepCost, "drafting_beats", lambda self, *args: True)
    monkeypatch.setattr(PlainStepCost, "beaten_by", lambda self, *args: True)
