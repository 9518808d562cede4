"""llmserve: LLM serving with a paged KV cache and continuous batching."""

__version__ = "0.1.0"

from llmserve.lora_request import LoRARequest  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch and the model code: import it lazily.
    if name == "LLM":
        from llmserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]
