"""Where a dense decoder's Hugging Face checkpoint tensors go: q/k/v into the fused qkv projection and gate/up into
gate_up (as shards of the fused parameter), per-expert tensors into the stacked experts (model/moe_names.py)."""

from __future__ import annotations

from llmserve.model.moe_names import map_expert_name

FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
SHARDS_OF = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


def map_hf_name(hf_name: str, skips_head: bool, fuses_qkv: bool = True) -> tuple[str, str | None] | None:
    """HF name -> (our parameter name, shard or None); None for tensors we skip. fuses_qkv=False keeps q_proj
    (MLA's, without LoRA) whole."""
    if "rotary_emb.inv_freq" in hf_name or (skips_head and hf_name == "lm_head.weight"):
        return None
    expert = map_expert_name(hf_name)
    if expert is not None:
        return expert
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED and (fuses_qkv or FUSED[parts[-2]][0] != "qkv_proj"):
        fused, shard = FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard
    return hf_name, None
