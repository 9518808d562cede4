"""Token sampling: batch the rows' SamplingParams (metadata), then sample (sampler)."""

from llmserve.sample.metadata import SamplingMetadata, SamplingRow, build_sampling_metadata
from llmserve.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow",
           "build_sampling_metadata"]
