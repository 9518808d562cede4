"""How an embedding model (`--runner pooling`) turns a prompt's hidden states into one vector.

`PoolerConfig` is resolved once per model (model/pooler_config.py: the checkpoint's sentence-transformers
files, else last-token pooling, normalised, as vLLM does for decoder embedders like Qwen3-Embedding; then
`--pooler-config`), crosses to the front inside ModelInfo, and is what both sides read: the runner pools
(worker/pooler.py), the front checks and applies a request's `dimensions` (Matryoshka truncation).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.json_flags import parse_json_object_flag

RUNNERS = ("generate", "pooling")  # vLLM's --runner values that llmserve serves
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's names: the last prompt token, the mean of all, the first


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True  # L2-normalise the pooled vector (and again after a `dimensions` truncation)
    # Matryoshka: the model was trained so that a prefix of its vector is an embedding too. None: not such
    # a model (`dimensions` refused); (): any size up to the hidden size; else only these sizes.
    matryoshka_dimensions: tuple[int, ...] | None = None

    def validate(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false; got {self.normalize!r}")

    def check_dimensions(self, dimensions: int, hidden_size: int) -> None:
        """ValueError unless a request may truncate this model's vectors to `dimensions`."""
        if self.matryoshka_dimensions is None:
            raise ValueError("this model does not support Matryoshka truncation: `dimensions` is only for "
                             "models trained for it (config.json's is_matryoshka or matryoshka_dimensions)")
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(f"dimensions must be in 1..{hidden_size} (the model's size); got {dimensions}")
        allowed = self.matryoshka_dimensions
        if allowed and dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {', '.join(map(str, allowed))} for this model; "
                             f"got {dimensions}")


OVERRIDE_KEYS = ("pooling_type", "normalize")  # --pooler-config's keys (vLLM's names)


def parse_pooler_override(text: str | None) -> dict:
    """--pooler-config's JSON as {key: value}; ValueError naming the flag and the key that is wrong."""
    if text is None:
        return {}
    settings = parse_json_object_flag("pooler-config", text, OVERRIDE_KEYS)
    if "pooling_type" in settings:
        settings["pooling_type"] = str(settings["pooling_type"]).upper()
    try:
        PoolerConfig(**settings).validate()
    except ValueError as e:
        raise ValueError(f"--pooler-config: {e}") from None
    return settings
