"""dsv4c.runtime: load compiled artifacts and generate (`Session`), sampling."""
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.runtime.session import GenerationResult, Session

__all__ = ["GenerationResult", "SamplingParams", "Session"]
