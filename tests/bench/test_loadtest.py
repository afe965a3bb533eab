"""The load test's summary of its requests and its reading of a llamactl server's /metrics around a
level (bench.loadtest)."""

from __future__ import annotations

from llamactl.bench.loadtest import _server_side, summarize


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


def test_time_per_output_token_counts_tokens_not_chunks():
    # a speculating server sends 5 tokens in 2 chunks a second apart: 4 gaps between tokens in 1 s
    spec = {"ok": True, "start": 0.0, "chunks": [0.5, 1.5], "end": 1.5, "output_tokens": 5,
            "prompt_tokens": 8, "error": None}
    plain = {**spec, "chunks": [0.5, 1.0, 1.5], "output_tokens": 3}
    row = summarize([spec, plain], wall=2.0)
    assert row["itl_ms_p50"] > 400  # between chunks
    assert row["tpot_ms_mean"] == (250.0 + 500.0) / 2 and row["output_tokens_mean"] == 4
