"""The demo's fault mix: which faults fire where, and how often."""

from __future__ import annotations

from dataclasses import dataclass

from ..testing import BOUNDARIES

# Where the API process may die: every boundary the request path has (the enqueuer's
# after_publish is the enqueuer's own).
API_BOUNDARIES = tuple(b for b in BOUNDARIES if b != "after_publish")
# A ride request meets about this many boundaries per attempt: before and after each
# of its two commits, before and after its foreign step (see demo/rocket_rides/api.py).
_BOUNDARIES_PER_ATTEMPT = 6


@dataclass(frozen=True)
class FaultMix:
    """Probabilities of each fault; every one is 0 when no fault is wanted.

    ``api_exit`` is per boundary the request passes (``os._exit`` in the API process);
    ``provider_before`` and ``provider_after`` are per charge request (a 500 before
    charging; a charge, then a 500 or a dropped connection); ``enqueuer_exit`` is per
    published receipt (``os._exit`` between publish and delete).
    """

    api_exit: float = 0.0
    provider_before: float = 0.0
    provider_after: float = 0.0
    enqueuer_exit: float = 0.0

    @classmethod
    def from_percent(cls, percent: float) -> FaultMix:
        """About ``percent`` % of request attempts meet a fault: half of them an API
        process killed at a random phase boundary, a quarter a provider failing before
        the charge, a quarter one failing after it. The enqueuer, which publishes in
        batches that a crash re-publishes whole, dies at a tenth of that rate per job."""
        if not 0 <= percent <= 100:
            raise ValueError(f"fault percent must be within 0..100, got {percent}")
        p = percent / 100
        return cls(
            api_exit=p / 2 / _BOUNDARIES_PER_ATTEMPT,
            provider_before=p / 4,
            provider_after=p / 4,
            enqueuer_exit=p / 10,
        )

    def api_spec(self) -> str:
        """``RECOVERYPOINT_FAULTS`` for the API processes."""
        return _spec(API_BOUNDARIES, self.api_exit)

    def enqueuer_spec(self) -> str:
        """``RECOVERYPOINT_FAULTS`` for the enqueuer."""
        return _spec(("after_publish",), self.enqueuer_exit)

    def describe(self) -> str:
        if not any((self.api_exit, self.provider_before, self.provider_after, self.enqueuer_exit)):
            return "none"
        return (
            f"API process exits at each phase boundary {self.api_exit:.1%} "
            f"(~{self.api_exit * _BOUNDARIES_PER_ATTEMPT:.0%} of attempts); "
            f"provider fails before charging {self.provider_before:.0%}, "
            f"after charging {self.provider_after:.0%} (a 500 or a dropped connection); "
            f"enqueuer exits between publish and delete {self.enqueuer_exit:.0%} of receipts"
        )


def _spec(boundaries: tuple[str, ...], probability: float) -> str:
    if probability <= 0:
        return ""
    return ",".join(f"{boundary}:*={probability:.6f}" for boundary in boundaries)
