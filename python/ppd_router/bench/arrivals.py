"""Open-loop Poisson arrival schedules for conversations.

Arrival times are drawn up front from a seeded generator, so a run's schedule
depends only on (qps, duration, seed) and never on how fast the server answers.
"""

from __future__ import annotations

import random

from ppd_router.errors import ConfigError


def poisson_arrivals(qps: float, duration: float, seed: int = 0) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process with rate ``qps`` per second.

    Gaps are exponential with mean 1/qps; the first arrival is one gap after 0.
    """
    if not qps > 0:
        raise ConfigError(f"qps must be positive, got {qps}")
    if not duration > 0:
        raise ConfigError(f"duration must be positive, got {duration}")
    rng = random.Random(f"arrivals:{seed}")
    times: list[float] = []
    t = rng.expovariate(qps)
    while t < duration:
        times.append(t)
        t += rng.expovariate(qps)
    return times
