"""dsv4c.runtime: load compiled artifacts and generate (`Session`, batch or incremental), sampling. The
server's parts, `engine` and `serve`, are imported by name (serve needs the `serve` extra)."""
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.runtime.session import GenerationResult, Session, StepError, StepOutput

__all__ = ["GenerationResult", "SamplingParams", "Session", "StepError", "StepOutput"]
