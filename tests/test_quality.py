"""The quality report's default size: a GPU's fixed count, a CPU's by the model (minutes, not hours)."""

from __future__ import annotations

import torch

from llamactl.quality import GPU_EVAL_TOKENS, announce, default_eval_tokens, expected_cpu_seconds
from llamactl.runtime.cores import usable


def test_the_cpu_default_follows_the_model_and_the_gpu_keeps_its_count():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert default_eval_tokens(gpu, 8_000_000_000) == GPU_EVAL_TOKENS
    assert default_eval_tokens(cpu, 17_000_000) == GPU_EVAL_TOKENS  # the embedded model: as before
    small = default_eval_tokens(cpu, 135_000_000)  # the third-party chat model of issue 56
    assert 2048 <= small <= 8192 and small % 512 == 0
    assert default_eval_tokens(cpu, 8_000_000_000) == 2048


def test_the_report_says_how_many_tokens_and_why(trained_model):
    from llamactl.folder.artifact import open_artifact

    art, lines = open_artifact(trained_model), []
    assert announce(1000, torch.device("cpu"), art, lines.append) == 1000 and "1,000 tokens" in lines[0]
    n = announce(None, torch.device("cpu"), art, lines.append)
    assert f"{n:,} tokens (the default on the cpu for this model; --eval-tokens sets it): expect about " in lines[1]
    assert announce(None, torch.device("cuda"), art, lines.append) == GPU_EVAL_TOKENS and "expect" not in lines[2]
    assert 60 < expected_cpu_seconds(17_000_000, 32_768) * usable() / 2 < 180  # 85 s measured


def test_the_kv_quality_harness_is_exact_for_a_16bit_cache_and_small_for_an_8bit_one(embedded):
    """quality.cache_logits: a cache of the model's own dtype gives the prefill's logits (so the KL
    it reports is the cache format's alone); an int8 cache adds a little KL, fp8 more."""
    import torch

    from llamactl.quality import cache_logits, compare, prefill_logits
    from llamactl.runtime.kv_format import KVFormat, resolve

    _, model, tok = embedded
    ids = torch.tensor([tok("The model folder holds the weights, the tokenizer and a manifest of how it was made. " * 6)
                        .input_ids[:96]])
    with torch.inference_mode():
        same = cache_logits(KVFormat.of(torch.float32))(model, ids)
        assert torch.allclose(same, prefill_logits(model, ids), atol=1e-4, rtol=1e-4)
    kl = {k: compare(model, model, ids, child_logits=cache_logits(resolve(k, torch.float32))).kl_mean
          for k in ("int8", "fp8")}
    assert 0 < kl["int8"] < kl["fp8"] < 0.05, kl
