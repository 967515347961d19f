"""What the coordinator tells or does to the world outside: webhooks, node exclusion and
abort actions, Prometheus metrics and gauges.

`metrics` is a leaf every part may import (the counters they bump); the rest read the live
state and the incidents.
"""
