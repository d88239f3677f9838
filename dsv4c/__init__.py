"""dsv4c: a compiler and runtime for the DeepSeek model family."""
from dsv4c.checkpoint import CheckpointError, load_model, save_checkpoint, write_random_checkpoint
from dsv4c.config import ConfigError, ModelConfig
from dsv4c.model import build_model

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "build_model", "load_model", "save_checkpoint",
           "write_random_checkpoint", "__version__"]
