"""A Session probe shared by the cache tests: generate() recording the logits row each request samples from."""
from __future__ import annotations

import torch

from dsv4c.runtime import Session


def serve(sess: Session, prompts, max_new: int = 4, **kw):
    """generate(), recording every logits row a request samples from (decode steps one at a time, their
    logits on the host: `Session.host_steps`)."""
    rec: dict[int, list[torch.Tensor]] = {}
    emit = sess._emit

    def recording(r, logits, *tok):
        rec.setdefault(r.index, []).append(logits.float().cpu().clone())
        yield from emit(r, logits, *tok)

    sess._emit = recording
    sess.host_steps = True
    try:
        with torch.no_grad():
            out = sess.generate(prompts, max_new_tokens=max_new, temperature=kw.pop("temperature", 1.0), seed=5, **kw)
    finally:
        del sess._emit
        sess.host_steps = False
    return [r.tokens for r in out], [torch.stack(rec[i]) for i in range(len(prompts))]
