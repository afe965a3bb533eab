import shutil, torch
from transformers import LlamaConfig, LlamaForCausalLM
from llamactl.artifact import DEFAULT_MODEL
cfg = LlamaConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5)
torch.manual_seed(0)
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained("w576")
for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
    try: shutil.copy(DEFAULT_MODEL / f, "w576/" + f)
    except FileNotFoundError: pass
print(sum(p.numel() for p in m.parameters()) / 1e6, "M params")
