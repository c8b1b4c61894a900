"""How many examples the property tests run.  Two profiles: "ci", the default, runs a
third of each test's examples (the suite must finish in ten minutes on two slow cores),
and "slow" (`pytest --hypothesis-profile=slow`) runs them all.  A test that wants more
than hypothesis's 100 says how many it would run under "slow": `examples(300)`."""

from __future__ import annotations

from hypothesis import settings

FULL = 100  # hypothesis's own default: what examples(n) means by n under "slow"
settings.register_profile("slow", max_examples=FULL)
settings.register_profile("ci", max_examples=34)
settings.load_profile("ci")  # the plugin loads another when --hypothesis-profile names one


def examples(n: int) -> int:
    """`n` examples under the slow profile, the same share of them under the loaded one
    (read when the test module is imported, after the profile is chosen)."""
    return max(10, n * settings.default.max_examples // FULL)
