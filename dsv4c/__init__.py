"""dsv4c: a compiler and runtime for the DeepSeek model family."""
from dsv4c.config import ConfigError, ModelConfig

__version__ = "0.1.0"

__all__ = ["ConfigError", "ModelConfig", "__version__"]
