"""agentkv: persistent, quantized per-agent KV caches for multi-agent LLM workflows.

Import agentkv before mlx: on Linux it first gives MLX's CPU backend a fast BLAS
(see ``agentkv._blas``).
"""

from ._blas import STATUS as BLAS_STATUS  # noqa: I001  (must run before mlx.core loads)
from . import _quiet  # noqa: F401  (drops known third-party noise before it is logged)
from . import _numerics  # noqa: F401  (float32 matmuls in full precision, before mlx.core)

import mlx.core  # noqa: F401

from .engine import (
    AgentInfo,
    ChatResult,
    ChatStream,
    Constraint,
    Engine,
    EngineConfig,
    ToolSpec,
    TurnStats,
)
from .errors import (
    AgentBusyError,
    AgentKVError,
    CacheFormatError,
    EngineBusyError,
    InvalidAgentIdError,
    InvalidRequestError,
    ModelImportError,
    TurnFailedError,
)
from .kv.cache import AgentKVCache
from .format.quant import KVQuant
from .prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

__version__ = "0.1.0"
__all__ = [
    "BLAS_STATUS",
    "AgentBusyError",
    "AgentInfo",
    "AgentKVCache",
    "AgentKVError",
    "CacheFormatError",
    "ChatResult",
    "ChatStream",
    "Constraint",
    "Engine",
    "EngineBusyError",
    "EngineConfig",
    "InvalidAgentIdError",
    "InvalidRequestError",
    "KVQuant",
    "ModelImportError",
    "ToolSpec",
    "TurnFailedError",
    "TurnStats",
    "__version__",
    "load_prompt_cache",
    "make_prompt_cache",
    "save_prompt_cache",
]
