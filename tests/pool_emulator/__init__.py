"""The pool-autoscale emulator: KEDA's and the HPA's rules (autoscale.py), a pool of real worker
processes (worker_pool.py) and the bursty scenario with its timeline (scenario.py). Test support,
not shipped: tests/unit/test_autoscale.py, tests/integration/test_pool_autoscale.py and
scripts/pool_autoscale.py use it."""
