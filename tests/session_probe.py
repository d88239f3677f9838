"""A Session probe shared by the cache tests: generate() recording the logits row each request samples from."""
from __future__ import annotations

import torch

from dsv4c.runtime import Session


def serve(sess: Session, prompts, max_new: int = 4, **kw):
    """generate(), recording every logits row a request samples from (sampling: one step at a time)."""
    rec: dict[int, list[torch.Tensor]] = {}
    emit = sess._emit

    def recording(r, logits):
        rec.setdefault(r.index, []).append(logits.float().cpu().clone())
        yield from emit(r, logits)

    sess._emit = recording
    try:
        with torch.no_grad():
            out = sess.generate(prompts, max_new_tokens=max_new, temperature=kw.pop("temperature", 1.0), seed=5, **kw)
    finally:
        del sess._emit
    return [r.tokens for r in out], [torch.stack(rec[i]) for i in range(len(prompts))]
