"""KEDA and the HPA as a few lines of arithmetic: what a cluster decides from the pool-demand signal
at each poll, so that a pool of worker processes on one machine can be scaled the way
infra/k8s/keda-kv-demand.yaml scales a Deployment (worker_pool.py starts and stops the processes,
scenario.py drives both).

The rules, as KEDA v2 and the Kubernetes HPA (autoscaling/v2) apply them:

- KEDA activation: at 0 replicas, a metric above `activationTargetValue` scales the target to
  max(1, minReplicaCount); below it the target stays at 0 and the HPA is not consulted.
- KEDA deactivation: `cooldownPeriod` seconds after the metric was last above the activation
  value, the target goes to minReplicaCount (0). While active, the HPA decides.
- The HPA, on an external metric of type AverageValue: desired = ceil(metric / targetValue), kept
  at the current count while metric / (targetValue * replicas) is within the tolerance (10%) of 1,
  bounded to [max(1, minReplicaCount), maxReplicaCount] (KEDA gives the HPA a minimum of 1).
- Stabilisation: a scale-down goes only as low as the highest desired count of the last
  `scale_down_window_s` seconds; a scale-up happens at once (keda-kv-demand.yaml's scale-up window
  is 0).

Not modelled: the HPA's rate policies (pods per period; with a handful of replicas a step is never
larger than they allow), its 15 s sync period (here: every poll), and the delay of the metrics
adapter.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# The HPA's default --horizontal-pod-autoscaler-tolerance.
HPA_TOLERANCE = 0.1


@dataclass(frozen=True)
class ScalingPolicy:
    """A ScaledObject's numbers, in the signal's unit (KV blocks) and in seconds."""

    # The trigger's targetValue: one replica's share of the metric (capacity * utilisation).
    target_value: float
    max_replicas: int
    min_replicas: int = 0
    # activationTargetValue: 0 -> 1 replica once the metric is above it.
    activation_value: float = 0.0
    cooldown_s: float = 300.0
    # behavior.scaleDown.stabilizationWindowSeconds (the HPA's default is 300).
    scale_down_window_s: float = 300.0
    tolerance: float = HPA_TOLERANCE

    def __post_init__(self) -> None:
        if self.target_value <= 0:
            raise ValueError(f"target_value must be > 0, got {self.target_value}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                f"got {self.min_replicas} and {self.max_replicas}"
            )
        if self.cooldown_s < 0 or self.scale_down_window_s < 0 or self.tolerance < 0:
            raise ValueError("cooldown_s, scale_down_window_s and tolerance must be >= 0")


@dataclass(frozen=True)
class ScalingDecision:
    # The replica count the target should have now.
    replicas: int
    # The HPA's count before stabilisation (KEDA's 0 or 1 where KEDA decided alone).
    desired: int
    # The metric is above the activation value.
    is_active: bool


class Autoscaler:
    """KEDA plus the HPA for one ScaledObject: call decide() once per poll."""

    def __init__(self, policy: ScalingPolicy) -> None:
        self.policy = policy
        self._last_active_at: float | None = None
        # (time, HPA desired count) over the scale-down window.
        self._recommendations: deque[tuple[float, int]] = deque()

    def hpa_desired(self, metric: float, replicas: int) -> int:
        """The HPA's count for an AverageValue metric, before stabilisation."""
        p = self.policy
        desired = math.ceil(max(0.0, metric) / p.target_value)
        if replicas > 0 and abs(metric / (p.target_value * replicas) - 1.0) <= p.tolerance:
            desired = replicas
        return min(p.max_replicas, max(1, p.min_replicas, desired))

    def decide(self, now: float, metric: float, replicas: int) -> ScalingDecision:
        """`now`: seconds on any monotonic clock; `metric`: this poll's reading; `replicas`: the
        target's current count."""
        p = self.policy
        is_active = metric > p.activation_value
        if is_active or self._last_active_at is None:
            # KEDA counts the cooldown from the last active reading (or from when it started).
            self._last_active_at = now
        if replicas == 0:
            self._recommendations.clear()
            if is_active:
                woken = max(1, p.min_replicas)
                return ScalingDecision(woken, woken, True)
            return ScalingDecision(p.min_replicas, p.min_replicas, False)
        if not is_active and p.min_replicas == 0 and now - self._last_active_at >= p.cooldown_s:
            self._recommendations.clear()
            return ScalingDecision(0, 0, False)

        desired = self.hpa_desired(metric, replicas)
        self._recommendations.append((now, desired))
        while self._recommendations and self._recommendations[0][0] < now - p.scale_down_window_s:
            self._recommendations.popleft()
        # The HPA's stabilizeRecommendationWithBehaviors, with a scale-up window of 0: up to the
        # new count at once, down only to the highest count recommended within the window.
        highest_recent = max(n for _, n in self._recommendations)
        target = max(replicas, desired)
        target = min(target, highest_recent)
        return ScalingDecision(target, desired, is_active)
