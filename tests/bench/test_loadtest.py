"""The load test's reading of a llamactl server's /metrics around a level (bench.loadtest)."""

from __future__ import annotations

from llamactl.bench.loadtest import _server_side


def test_a_levels_server_side_is_the_difference_of_its_metrics():
    before = {"llamactl_engine_decode_steps": 10.0, "llamactl_engine_prefill_max_seconds": 0.5,
              "llamactl_engine_spec_proposed": 4.0, "llamactl_engine_spec_accepted": 1.0,
              "llamactl_prefix_cache_queried_tokens": 100.0, "llamactl_prefix_cache_hit_tokens": 0.0}
    after = {"llamactl_engine_decode_steps": 30.0, "llamactl_engine_prefill_max_seconds": 0.7,
             "llamactl_engine_spec_proposed": 24.0, "llamactl_engine_spec_accepted": 16.0,
             "llamactl_prefix_cache_queried_tokens": 300.0, "llamactl_prefix_cache_hit_tokens": 50.0}
    out = _server_side(before, after, requests=4)
    assert out["engine"]["decode_steps"] == 20.0 and out["engine"]["prefill_max_seconds"] == 0.7
    assert out["server"] == {"prefix_hit_rate": 0.25, "spec_acceptance": 0.75}
