"""Built-in chat templates, for checkpoints that ship none.

DeepSeek-V4's hub checkpoints describe their prompt format in Python (the model card's `encoding/`), not as a
Jinja chat template in tokenizer_config.json. `compile` writes `DEEPSEEK_V4` into the artifact as
chat_template.jinja when a V4 checkpoint brings no template of its own, so `dsv4c serve` can render chat
requests. It covers the format's chat part (system, user, developer and assistant turns, thinking and
non-thinking mode, the maximum reasoning effort); tool schemas, tool calls and the internal task tokens are
not in it.

The format (one prompt, no separators beyond these tokens):

    BOS [max-effort preamble] system  <｜User｜>user <｜Assistant｜></think>answer EOS  <｜User｜>user <｜Assistant｜><think>

- A user (or developer) turn is followed by `<｜Assistant｜>` and then `<think>` when the model is to think
  (thinking mode, and this is the last user turn) or `</think>` when it is to answer directly.
- An assistant turn before the last user turn is its answer and EOS: earlier reasoning is dropped from the
  context. One after the last user turn (a prefilled reply) keeps its reasoning, closed by `</think>`, in
  thinking mode.
- In thinking mode developer turns before the last user turn are dropped too.

Variables: `thinking` (default false; a request's `chat_template_kwargs`), `reasoning_effort` ("max" puts the
maximum-effort preamble after BOS in thinking mode; anything else adds nothing).
"""
from __future__ import annotations

import json
from pathlib import Path

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
MAX_EFFORT_PREAMBLE = (  # the model card's text for reasoning_effort = "max", verbatim: the model was trained on it
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


def _jinja_string(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


DEEPSEEK_V4 = (
    "{%- set thinking = thinking | default(false) -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] in ['user', 'developer'] -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{{- bos_token -}}"
    "{%- if thinking and reasoning_effort | default(none) == 'max' -%}"
    "{{- " + _jinja_string(MAX_EFFORT_PREAMBLE) + " -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set i = loop.index0 -%}"
    "{%- set content = m['content'] or '' -%}"
    "{%- if m['role'] == 'system' -%}{{- content -}}"
    "{%- elif m['role'] == 'user' or (m['role'] == 'developer' and not (thinking and i < ns.last_user)) -%}"
    "{{- '" + USER + "' + content -}}"
    "{%- if loop.last and add_generation_prompt or not loop.last and loop.nextitem['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + "' + ('" + THINK + "' if thinking and i >= ns.last_user else '" + END_THINK + "') -}}"
    "{%- endif -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if thinking and i > ns.last_user -%}{{- (m.get('reasoning_content') or '') + '" + END_THINK + "' -}}"
    "{%- endif -%}"
    "{{- content + eos_token -}}"
    "{%- elif m['role'] != 'developer' -%}{{- raise_exception('unknown role: ' ~ m['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def builtin_chat_template(config) -> str | None:
    """The built-in template for a model config (`DEEPSEEK_V4` for V4), or None."""
    return DEEPSEEK_V4 if config.is_v4 else None


def load_chat_template(folder: Path) -> str | None:
    """A checkpoint's or artifact's chat template: `chat_template.jinja`, else tokenizer_config.json's
    `chat_template` (a string, or a list of {name, template}: the one named "default"); None without one."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    t = json.loads(cfg.read_text()).get("chat_template")
    if isinstance(t, list):
        t = next((x["template"] for x in t if x.get("name") == "default"), None)
    return t
