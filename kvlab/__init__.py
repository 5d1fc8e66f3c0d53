"""kvlab: a small, readable LLM serving engine for learning how vLLM manages the KV cache.

The public API mirrors vLLM's offline API: `LLM`, `SamplingParams`, `RequestOutput`,
`LLMEngine`, with `cache_salt` in the prompt dict and vLLM's knob names.
"""

from kvlab.beam_search import BeamSearchOutput, BeamSearchParams
from kvlab.config import EngineConfig
from kvlab.engine import LLM, LLMEngine
from kvlab.model import load_model
from kvlab.outputs import CompletionOutput, RequestOutput
from kvlab.sampling import SamplingParams
from kvlab.utils import seed_everything

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "RequestOutput",
    "CompletionOutput",
    "load_model",
    "seed_everything",
]
