"""Write a Hugging Face folder of a named synthetic shape (random N(0, 0.02) weights, bf16) with the
embedded model's tokenizer: a checkpoint for tools that need files (llama.cpp through
`llamactl convert FOLDER -o FILE.gguf`, quantize), for speed comparisons only.

Usage: python scripts/synthetic_folder.py SHAPE OUT [tied]   (SHAPE: a --synthetic name, e.g. llama-135m;
tied: one embedding table for the input and the head, as small chat models have)
"""

import json
import shutil
import sys
from pathlib import Path

import torch

from llamactl.folder.artifact import DEFAULT_MODEL, save_weights
from llamactl.runtime.synthetic import build_synthetic, hf_config, synthetic_args


def main(shape: str, out: str, tied: bool = False) -> None:
    folder = Path(out)
    folder.mkdir(parents=True)
    model = build_synthetic(shape, torch.device("cpu"), torch.bfloat16)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("rope_", "causal"))}
    if tied:
        state.pop("lm_head.weight")
    save_weights(state, folder)
    config = hf_config(synthetic_args(shape)) | {"torch_dtype": "bfloat16", "dtype": "bfloat16",
                                                 "tie_word_embeddings": tied}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(DEFAULT_MODEL / name, folder / name)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["tied"])
