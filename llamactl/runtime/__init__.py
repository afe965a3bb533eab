"""LLaMA in memory: the model, its KV cache, loading, the fixed-shape steps, graphs, sampling."""
