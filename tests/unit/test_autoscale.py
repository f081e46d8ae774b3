"""The KEDA + HPA arithmetic of tests/pool_emulator/autoscale.py, poll by poll."""

from __future__ import annotations

import pytest

from tests.pool_emulator.autoscale import Autoscaler, ScalingPolicy
from tests.pool_emulator.scenario import Burst, bursty_config, plan_jobs

pytestmark = pytest.mark.timeout(30)

POLICY = ScalingPolicy(target_value=100.0, max_replicas=4, cooldown_s=5.0, scale_down_window_s=3.0)


def play(policy: ScalingPolicy, metrics: list[float]) -> list[int]:
    """Replica counts after each one-second poll, the target following every decision."""
    scaler = Autoscaler(policy)
    replicas, out = 0, []
    for t, metric in enumerate(metrics):
        replicas = scaler.decide(float(t), metric, replicas).replicas
        out.append(replicas)
    return out


def test_activation_wakes_one_replica_then_the_hpa_takes_over():
    assert play(POLICY, [0, 0, 250, 250]) == [0, 0, 1, 3]


def test_the_hpa_rule_is_ceil_of_metric_over_target_bounded():
    scaler = Autoscaler(POLICY)
    assert scaler.hpa_desired(250, 1) == 3
    assert scaler.hpa_desired(10_000, 1) == 4  # max_replicas
    assert scaler.hpa_desired(1, 3) == 1  # at least 1 while KEDA keeps the target active
    # Within 10% of the target per replica: no change.
    assert scaler.hpa_desired(209, 2) == 2
    assert scaler.hpa_desired(221, 2) == 3


def test_scale_down_waits_for_the_stabilisation_window():
    # From 3 replicas the demand drops to one replica's worth at t=2; the window is 3 s.
    assert play(POLICY, [250, 250, 80, 80, 80, 80, 80]) == [1, 3, 3, 3, 3, 1, 1]
    # A spike inside the window holds the count up.
    assert play(POLICY, [250, 250, 80, 80, 250, 80, 80, 80, 80]) == [1, 3, 3, 3, 3, 3, 3, 3, 1]


def test_scale_up_is_immediate():
    assert play(POLICY, [80, 80, 380]) == [1, 1, 4]


def test_cooldown_then_zero_and_activation_again():
    metrics = [150, 150, 0, 0, 0, 0, 0, 0, 0, 40]
    # Inactive from t=2; the last active reading was at t=1, so 0 at t=6; woken again at t=9.
    assert play(POLICY, metrics) == [1, 2, 2, 2, 2, 1, 0, 0, 0, 1]


def test_a_reading_above_activation_resets_the_cooldown():
    metrics = [50, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert play(POLICY, metrics) == [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]


def test_min_replicas_keeps_the_pool_warm():
    warm = ScalingPolicy(
        target_value=100.0, max_replicas=2, min_replicas=1, cooldown_s=1.0, scale_down_window_s=0
    )
    assert play(warm, [0, 0, 0, 150, 0, 0]) == [1, 1, 1, 2, 1, 1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_value": 0, "max_replicas": 1},
        {"target_value": 1, "max_replicas": 0},
        {"target_value": 1, "max_replicas": 1, "min_replicas": 2},
        {"target_value": 1, "max_replicas": 1, "cooldown_s": -1},
    ],
)
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        ScalingPolicy(**kwargs)


def test_plan_jobs_is_deterministic_and_checks_the_order_of_triggers():
    config = bursty_config()
    a, b = plan_jobs(config.bursts, seed=3), plan_jobs(config.bursts, seed=3)
    assert a == b
    assert [len(a[burst.name]) for burst in config.bursts] == [burst.num_jobs for burst in config.bursts]
    trickle = a["trickle-1"]
    assert all(700 <= p.job["params"]["max_tokens"] <= 960 for p in trickle)
    assert [p.offset_s for p in trickle[:3]] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="not before it"):
        plan_jobs([Burst("x", 0.0, 1, after="y")], seed=0)
