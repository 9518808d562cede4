"""Random PEFT LoRA adapters (every projection, non-zero A and B) of a checkpoint, for benchmarks: writes
OUT/a0 ... OUT/a{N-1} and prints the --lora-modules arguments. Needs peft (the test extra).

usage: python scripts/cpu/make_lora_adapters.py BASE_DIR OUT_DIR NUM_ADAPTERS [RANK]
"""
import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    base, out, num_adapters = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    modules = []
    for i in range(num_adapters):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False)
        path = os.path.join(out, f"a{i}")
        get_peft_model(model, config).save_pretrained(path)
        modules.append(f"a{i}={path}")
    print(" ".join(modules))


if __name__ == "__main__":
    main()
