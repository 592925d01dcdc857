"""coserve: an LLM inference server that fine-tunes LoRA adapters in the capacity inference leaves idle."""

from coserve.engine.config import EngineConfig
from coserve.engine.llm import LLM
from coserve.engine.llm_engine import InvalidRequestError, LLMEngine
from coserve.engine.outputs import CompletionOutput, RequestOutput
from coserve.engine.sampling_params import SamplingParams
from coserve.engine.sequence import LoRARequest

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
