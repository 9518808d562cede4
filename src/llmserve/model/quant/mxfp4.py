"""gpt-oss's MXFP4 experts (`quantization_config.quant_method: mxfp4`, how its released weights ship),
dequantized as they stream in.

Such a checkpoint stores each stacked expert matrix `mlp.experts.{gate_up_proj,down_proj}` as
`{name}_blocks` uint8 [E, rows, G, 16] (two FP4 e2m1 values per byte, the low nibble first; G groups of 32
input features per row) and `{name}_scales` uint8 [E, rows, G] (one power-of-two exponent per group, biased by
127); everything else is bfloat16. Each pair becomes the float32 tensor a bfloat16 checkpoint holds under
`{name}`, [E, inputs, outputs] (transformers' `convert_moe_packed_tensors`), so the model reads both alike. The
experts then run in the model's dtype: the memory of a bf16 checkpoint, not MXFP4's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

QUANT_METHOD = "mxfp4"
ARCHITECTURE = "GptOssForCausalLM"  # the only one whose MXFP4 layout is read
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1
_SUFFIXES = ("_blocks", "_scales")


def is_mxfp4(hf_config) -> bool:
    """Whether a config's checkpoint holds MXFP4 experts; ValueError for an architecture other than gpt-oss."""
    qc = getattr(hf_config, "quantization_config", None)
    qc = qc if qc is None or isinstance(qc, dict) else qc.to_dict()
    if qc is None or qc.get("quant_method") != QUANT_METHOD:
        return False
    architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if architecture != ARCHITECTURE:
        raise ValueError(f"quantization_config.quant_method 'mxfp4' is read for {ARCHITECTURE} only, "
                         f"not {architecture}")
    return True


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [E, rows, G, 16], scales uint8 [E, rows, G] -> float32 [E, G * 32, rows]; one expert at
    a time, so the temporaries stay one expert's size."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         "(expected [..., G, 16] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    return torch.stack([_dequantize_expert(b, s, lut) for b, s in zip(blocks, scales, strict=True)])


def _dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """blocks [rows, G, 16], scales [rows, G] -> [G * 32, rows] float32."""
    codes = blocks.to(torch.int64)
    values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).flatten(-2)  # [rows, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)  # exact: a power of two
    return values.flatten(-2).t()  # [G * 32, rows]


def dequantize_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each `{name}_blocks` / `{name}_scales` pair replaced by `{name}` float32;
    ValueError when one of a pair is missing."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if not name.endswith(_SUFFIXES):
            yield name, tensor
            continue
        base, kind = name[:-len("_blocks")], name[-len("blocks"):]
        pending.setdefault(base, {})[kind] = tensor
        if len(pending[base]) == 2:
            parts = pending.pop(base)
            yield base, dequantize(parts["blocks"], parts["scales"])
    if pending:
        raise ValueError(f"MXFP4 checkpoint: {sorted(pending)[0]!r} lacks its blocks or its scales")
