"""How hard a client tries: the retry policy, the backoff schedule and the
per-operation budget of attempts and time.

No I/O here: the sync client (and later the async one) feed these the clock
and act on the delays they return.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Budget", "RetryPolicy", "backoff_delay"]

# 2**60 times any sane base is far past any sane cap; the clamp keeps the
# float arithmetic from overflowing after very many failures.
_MAX_EXPONENT = 60
# Every wait is bounded: a socket's timeout cannot be infinite anyway.
_FOREVER = float("inf")


class RetryPolicy:
    """Bounds on retrying one operation (a call with all its retries and polls).

    Frozen and hashable. This is a hand-written class rather than a dataclass
    because `dataclasses` would add tens of milliseconds to the client's import.

    Attributes:
        attempts: How many times a request may fail at the transport before
            the operation gives up (at least 1; 1 means no retry).
        backoff_base: Upper bound of the first backoff delay, in seconds.
        backoff_max: Cap on the upper bound of any backoff delay, in seconds.
        deadline: Overall time for the operation, in seconds, polling
            included. A call still in flight when it passes raises
            `EffectUnknown`.
    """

    __slots__ = ("_attempts", "_backoff_base", "_backoff_max", "_deadline")

    _attempts: int
    _backoff_base: float
    _backoff_max: float
    _deadline: float

    def __init__(
        self,
        *,
        attempts: int = 5,
        backoff_base: float = 0.05,
        backoff_max: float = 2.0,
        deadline: float = 120.0,
    ) -> None:
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, not {attempts!r}")
        if not backoff_base > 0:
            raise ValueError(f"backoff_base must be > 0, not {backoff_base!r}")
        if not backoff_max >= backoff_base:
            raise ValueError(f"backoff_max must be >= backoff_base, not {backoff_max!r}")
        if not 0 < deadline < _FOREVER:
            raise ValueError(f"deadline must be a finite number of seconds > 0, not {deadline!r}")
        object.__setattr__(self, "_attempts", attempts)
        object.__setattr__(self, "_backoff_base", float(backoff_base))
        object.__setattr__(self, "_backoff_max", float(backoff_max))
        object.__setattr__(self, "_deadline", float(deadline))

    @property
    def attempts(self) -> int:
        """Failures at the transport one operation tolerates, first try included."""
        return self._attempts

    @property
    def backoff_base(self) -> float:
        """Upper bound of the first backoff delay, in seconds."""
        return self._backoff_base

    @property
    def backoff_max(self) -> float:
        """Cap on the upper bound of any backoff delay, in seconds."""
        return self._backoff_max

    @property
    def deadline(self) -> float:
        """Overall time for one operation, in seconds."""
        return self._deadline

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"RetryPolicy is frozen; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"RetryPolicy is frozen; cannot delete {name!r}")

    def _key(self) -> tuple[int, float, float, float]:
        return (self.attempts, self.backoff_base, self.backoff_max, self.deadline)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RetryPolicy):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"RetryPolicy(attempts={self.attempts}, backoff_base={self.backoff_base}, "
            f"backoff_max={self.backoff_max}, deadline={self.deadline})"
        )


def backoff_delay(
    policy: RetryPolicy,
    failures: int,
    uniform: Callable[[float, float], float] | None = None,
) -> float:
    """The delay before the retry that follows the `failures`-th failure.

    Exponential backoff with full jitter: a uniform draw from
    `[0, min(backoff_max, backoff_base * 2**(failures - 1))]`, so that
    guests that failed together do not retry together.

    Args:
        policy: The bounds.
        failures: How many failures so far (1 for the first).
        uniform: `random.uniform`-like source of jitter; the default is
            `random.uniform`, imported on first need.
    """
    exponent = min(max(failures - 1, 0), _MAX_EXPONENT)
    ceiling = min(policy.backoff_max, policy.backoff_base * 2.0**exponent)
    if uniform is None:
        import random  # Only a guest that retries pays for it.

        uniform = random.uniform
    return min(max(uniform(0.0, ceiling), 0.0), ceiling)


class Budget:
    """What is left of one operation's attempts and time.

    Mutable and owned by one operation; not shared between threads.

    Attributes:
        policy: The bounds.
        clock: Monotonic clock, in seconds.
        deadline: The clock value at which the operation gives up.
        failures: Transport failures so far.
        may_have_run: Whether a request that can run the tool may have
            reached the host (decides what a final `TransportError` says).
        uniform: Jitter source for `backoff_delay`, or None for `random`.
    """

    __slots__ = ("clock", "deadline", "failures", "may_have_run", "policy", "uniform")

    def __init__(
        self,
        policy: RetryPolicy,
        clock: Callable[[], float],
        *,
        timeout: float | None = None,
        uniform: Callable[[float, float], float] | None = None,
    ) -> None:
        if timeout is not None and not 0 < timeout < _FOREVER:
            raise ValueError(f"timeout must be a finite number of seconds > 0, not {timeout!r}")
        self.policy = policy
        self.clock = clock
        self.deadline = clock() + (policy.deadline if timeout is None else timeout)
        self.failures = 0
        self.may_have_run = False
        self.uniform = uniform

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it has passed)."""
        return self.deadline - self.clock()

    def next_delay(self) -> float:
        """The backoff delay after the latest failure."""
        return backoff_delay(self.policy, self.failures, self.uniform)
