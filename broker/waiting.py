"""Spin, then block: how long a waiter polls shared memory before it sleeps on a semaphore.

Polling sees an answer (or a request) within a loop turn but burns a core; blocking costs nothing
while idle, but waking a sleeping process costs tens to hundreds of microseconds on a VM. Every
waiter of Kalos makes that trade with this one object: a pool's poller and a blocking client
waiting for their answers, and the sidecar's loop waiting for requests. It holds numbers and
answers questions; the caller owns the clock and does the waiting (so a test needs neither).

    policy = SpinThenBlock(spin_us=250, max_spin_us=2000)
    while policy.spinning(clock() - since):   # poll ...
        ...
    ... then block; and after each round trip: policy.observe(round_trip_ns)
"""

from __future__ import annotations

#: The clients' polling window after a post (µs), and how far it may widen (µs).
DEFAULT_SPIN_US = 250.0
MAX_SPIN_US = 2000.0
#: Weight of the newest round trip in the typical one (an exponentially weighted mean).
SMOOTHING = 0.2


class SpinThenBlock:
    """Poll while :meth:`spinning`, then block.

    ``spin_us``: the polling window in microseconds; 0 never polls. ``max_spin_us``: how far the
    window widens to follow the typical round trip (to twice it, so that an answer a little slower
    than usual is still caught by polling, not by a wake-up); None, or not above ``spin_us``: the
    window stays ``spin_us`` (the sidecar's loop, which has no round trip to follow).
    """

    __slots__ = ("spin_ns", "max_spin_ns", "typical_ns")

    def __init__(self, spin_us: float, max_spin_us: float | None = None) -> None:
        self.spin_ns = int(spin_us * 1000)
        self.max_spin_ns = max(self.spin_ns, int((max_spin_us or 0.0) * 1000))
        self.typical_ns = 0.0  # the typical round trip seen by :meth:`observe`

    def window_ns(self) -> int:
        """How long to poll: ``spin_us``, or twice the typical round trip if that is longer, at
        most ``max_spin_us``; 0 when polling is off."""
        if not self.spin_ns:
            return 0
        return int(min(self.max_spin_ns, max(self.spin_ns, 2.0 * self.typical_ns)))

    def spinning(self, idle_ns: int) -> bool:
        """Keep polling after ``idle_ns`` without progress? False: block now."""
        return idle_ns < self.window_ns()

    def observe(self, round_trip_ns: float) -> None:
        """Account one round trip (post to answer, ns): the window follows the typical one."""
        self.typical_ns += SMOOTHING * (round_trip_ns - self.typical_ns)


__all__ = ["DEFAULT_SPIN_US", "MAX_SPIN_US", "SMOOTHING", "SpinThenBlock"]
