"""Suite-wide test settings.

Hypothesis runs without per-example deadlines or the too-slow health check: CI runs on a
shared 2-core machine where timing varies, and these tests check properties, not speed.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "topkv",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("topkv")
