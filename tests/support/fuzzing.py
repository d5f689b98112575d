"""What the suite's property-based tests (Hypothesis) share: the profiles, and JSON that
json.dumps cannot write.

The profile "kiln-ci" (the default) is derandomized (the same examples on every run), has no
deadline and no example database; each test's `max_examples` keeps it within CI's minutes
on two cores. `KILN_FUZZ_PROFILE=kiln-explore` runs random examples, ten times as many, for
hunting locally. Hypothesis writes nothing into the repository: its home directory is a
temporary one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, configuration, settings
from hypothesis import strategies as st

configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "kiln-hypothesis")

settings.register_profile(
    "kiln-ci", deadline=None, derandomize=True, database=None, print_blob=False,
    report_multiple_bugs=False,
    # Examples are HTTP round trips; big bodies are the point, not a smell.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.large_base_example])
settings.register_profile("kiln-explore", settings.get_profile("kiln-ci"), derandomize=False)
PROFILE = os.environ.get("KILN_FUZZ_PROFILE", "kiln-ci")
SCALE = 10 if PROFILE == "kiln-explore" else 1


def fuzz_settings(examples: int) -> settings:
    return settings(settings.get_profile(PROFILE), max_examples=examples * SCALE)


@dataclass(frozen=True)
class Raw:
    """A literal written into the body as it is."""
    text: str

    def __repr__(self) -> str:  # Hypothesis prints failing examples: keep 100k '[' short
        t = self.text
        return f"Raw({t!r})" if len(t) <= 60 else f"Raw({t[:30]!r} ... {t[-10:]!r}, {len(t)} chars)"


def dump(value) -> str:
    """JSON text of `value`, with `Raw` literals as they are and NaN/Infinity as Python's
    json writes them (not JSON: a server must refuse them with a 400, not a 5xx)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


# Literals past what a JSON reader takes: integers past Python's int-str limit, nesting past
# the recursion limit, the non-finite numbers.
huge_literals = st.builds(lambda n, sign, digit: Raw(sign + digit + "0" * n),
                          st.integers(4300, 6000), st.sampled_from(["", "-"]),
                          st.sampled_from("123456789"))
deep_literals = st.builds(
    lambda n, obj: Raw('{"a":' * n + "0" + "}" * n) if obj else Raw("[" * n + "]" * n),
    st.integers(900, 100_000), st.booleans())
non_finite = st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"),
                              Raw("-1e400")])
