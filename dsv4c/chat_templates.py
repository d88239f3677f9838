"""Built-in chat templates, for checkpoints that ship none, and the parser of DeepSeek-V4's tool calls.

DeepSeek-V4's hub checkpoints describe their prompt format in Python (the model card's `encoding/`), not as a
Jinja chat template in tokenizer_config.json. `compile` writes `DEEPSEEK_V4` into the artifact as
chat_template.jinja when a V4 checkpoint brings no template of its own, so `dsv4c serve` can render chat
requests. It covers system, user, developer, assistant and tool turns, thinking and non-thinking mode, the
maximum reasoning effort, tool schemas and tool calls (DSML); the internal task tokens are not in it.

The format (one prompt, no separators beyond these tokens):

    BOS [max-effort preamble] system  <｜User｜>user <｜Assistant｜></think>answer EOS  <｜User｜>user <｜Assistant｜><think>

- A user (or developer) turn is followed by `<｜Assistant｜>` and then `<think>` when the model is to think
  (thinking mode, and this is the last user turn) or `</think>` when it is to answer directly.
- An assistant turn before the last user turn is its answer and EOS: earlier reasoning is dropped from the
  context. One after the last user turn (a prefilled reply) keeps its reasoning, closed by `</think>`, in
  thinking mode.
- In thinking mode developer turns before the last user turn are dropped too.
- Consecutive user and tool turns are one user turn, their parts joined by a blank line; a tool turn's part
  is `<tool_result>content</tool_result>` (the caller puts results in the order of their calls).
- Tools (`tools`, OpenAI's [{"type": "function", "function": {...}}]) follow the first system turn's text
  after a blank line (or open the prompt when there is no system turn first): `TOOLS_HEAD`, one JSON line per
  function, `TOOLS_TAIL`. With tools, no reasoning is dropped: every assistant turn keeps its reasoning and
  every user turn is followed by `<think>` in thinking mode, and no developer turn is dropped.
- An assistant turn's tool calls follow its answer after a blank line as one DSML block, then EOS:

      <｜DSML｜tool_calls>
      <｜DSML｜invoke name="NAME">
      <｜DSML｜parameter name="KEY" string="true">text as is</｜DSML｜parameter>
      <｜DSML｜parameter name="KEY2" string="false">JSON</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  A call's `arguments` must be an object (the server parses OpenAI's JSON string before rendering).

Variables: `thinking` (default false; a request's `chat_template_kwargs`), `reasoning_effort` ("max" puts the
maximum-effort preamble after BOS in thinking mode; anything else adds nothing), `tools`. The template's JSON
uses the `tojson` filter as Hugging Face tokenizers define it (json.dumps, non-ASCII kept, no HTML escaping).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls>"  # where an answer's tool calls begin
MAX_EFFORT_PREAMBLE = (  # the model card's text for reasoning_effort = "max", verbatim: the model was trained on it
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
# the model card's tools section around the schemas (one JSON line per function), verbatim for the same reason
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    f"writing a \"<{DSML}tool_calls>\" block like the following:\n\n"
    f"<{DSML}tool_calls>\n<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n...\n"
    f"</{DSML}invoke>\n<{DSML}invoke name=\"$TOOL_NAME2\">\n...\n</{DSML}invoke>\n</{DSML}tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
    f"{THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


def _jinja_string(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


_J = _jinja_string
_TOOLS = (  # the tools section (a macro's body)
    "{{- " + _J(TOOLS_HEAD) + " -}}"
    "{%- for t in tools -%}{{- (t['function'] if t['function'] is defined else t) | tojson -}}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}{%- endfor -%}"
    "{{- " + _J(TOOLS_TAIL) + " -}}")
_CALLS = (  # an assistant turn's tool calls, `m`
    "{{- " + _J(f"\n\n<{DSML}tool_calls>\n") + " -}}"
    "{%- for tc in m['tool_calls'] -%}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc -%}"
    "{%- if f['arguments'] is not mapping -%}"
    "{{- raise_exception('tool call ' ~ f['name'] ~ ': arguments must be an object, not a JSON string') -}}"
    "{%- endif -%}"
    "{{- " + _J(f'<{DSML}invoke name="') + " + f['name'] + '\">\\n' -}}"
    "{%- for k, v in f['arguments'].items() -%}"
    "{{- " + _J(f'<{DSML}parameter name="') + " + k + '\" string=\"' + ('true' if v is string else 'false') + '\">' -}}"
    "{{- v if v is string else v | tojson -}}"
    "{{- " + _J(f"</{DSML}parameter>") + " -}}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}{%- endfor -%}"
    "{{- " + _J(f"\n</{DSML}invoke>") + " -}}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}{%- endfor -%}"
    "{{- " + _J(f"\n</{DSML}tool_calls>") + " -}}")

DEEPSEEK_V4 = (
    "{%- set thinking = thinking | default(false) -%}"
    "{%- set tools = tools | default(none) -%}"
    "{%- set keep = (tools or []) | length > 0 -%}"  # with tools no reasoning is dropped
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] in ['user', 'developer', 'tool'] -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{{- bos_token -}}"
    "{%- if thinking and reasoning_effort | default(none) == 'max' -%}"
    "{{- " + _J(MAX_EFFORT_PREAMBLE) + " -}}"
    "{%- endif -%}"
    "{%- if keep and (messages | length == 0 or messages[0]['role'] != 'system') -%}"
    "{{- '\\n\\n' -}}" + _TOOLS + "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set i = loop.index0 -%}"
    "{%- set content = m['content'] or '' -%}"
    "{%- set prev = messages[i - 1]['role'] if i > 0 else none -%}"
    "{%- set next = none if loop.last else loop.nextitem['role'] -%}"
    "{%- if m['role'] == 'system' -%}{{- content -}}"
    "{%- if keep and i == 0 -%}{{- '\\n\\n' -}}" + _TOOLS + "{%- endif -%}"
    "{%- elif m['role'] in ['user', 'tool'] or (m['role'] == 'developer'"
    " and (keep or not (thinking and i < ns.last_user))) -%}"
    "{{- '\\n\\n' if m['role'] != 'developer' and prev in ['user', 'tool'] else '" + USER + "' -}}"
    "{{- '<tool_result>' + content + '</tool_result>' if m['role'] == 'tool' else content -}}"
    "{%- if loop.last and add_generation_prompt or next == 'assistant' -%}"
    "{{- '" + ASSISTANT + "' + ('" + THINK + "' if thinking and (keep or i >= ns.last_user) else '" + END_THINK
    + "') -}}"
    "{%- endif -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if thinking and (keep or i > ns.last_user) -%}{{- (m.get('reasoning_content') or '') + '" + END_THINK
    + "' -}}"
    "{%- endif -%}"
    "{{- content -}}"
    "{%- if m.get('tool_calls') -%}" + _CALLS + "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- elif m['role'] != 'developer' -%}{{- raise_exception('unknown role: ' ~ m['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


class ToolCallFormatError(ValueError):
    """A completion's DSML tool-call block does not parse; the message says where."""


_INVOKE = re.compile(r'\s*<' + DSML + r'invoke name="([^"]*)">\n')
_PARAM = re.compile(r'\s*<' + DSML + r'parameter name="([^"]*)" string="(true|false)">(.*?)</' + DSML + r'parameter>',
                    re.DOTALL)
_END_INVOKE = re.compile(r'\s*</' + DSML + r'invoke>')
_END_CALLS = re.compile(r'\s*</' + DSML + r'tool_calls>\s*')


def parse_tool_calls(block: str) -> list[dict]:
    """The text after `TOOL_CALLS_START` (to the end of the completion) -> [{"name", "arguments"}] with
    `arguments` a JSON object's text. String parameters are taken as they are; the others must be JSON.
    Whitespace between tags is allowed; anything else raises ToolCallFormatError."""
    i, calls = 0, []
    while True:
        end = _END_CALLS.match(block, i)
        if end is not None:
            if end.end() != len(block):
                raise ToolCallFormatError(f"text after </{DSML}tool_calls>: {block[end.end():][:40]!r}")
            return calls
        inv = _INVOKE.match(block, i)
        if inv is None:
            raise ToolCallFormatError(f"expected <{DSML}invoke name=\"...\"> at {block[i:][:40]!r}")
        name, i, args = inv.group(1), inv.end(), {}
        while (p := _PARAM.match(block, i)) is not None:
            key, is_str, value = p.groups()
            if key in args:
                raise ToolCallFormatError(f"tool call {name}: parameter {key!r} given twice")
            try:
                args[key] = value if is_str == "true" else json.loads(value)
            except json.JSONDecodeError:
                raise ToolCallFormatError(f"tool call {name}: parameter {key!r} is not JSON: {value[:40]!r}") from None
            i = p.end()
        close = _END_INVOKE.match(block, i)
        if close is None:
            raise ToolCallFormatError(f"tool call {name}: expected a parameter or </{DSML}invoke> at "
                                      f"{block[i:][:40]!r}")
        i = close.end()
        calls.append({"name": name, "arguments": json.dumps(args, ensure_ascii=False)})


def split_tool_calls(text: str) -> tuple[str, list[dict]]:
    """An answer's text -> (its content before the tool calls, the calls); ([text], []) without a block.
    Raises ToolCallFormatError for a block that does not parse."""
    i = text.find(TOOL_CALLS_START)
    if i < 0:
        return text, []
    return text[:i], parse_tool_calls(text[i + len(TOOL_CALLS_START):])


PARSED_MARKERS = (DSML, THINK, END_THINK)  # what the server's reasoning and tool-call parsers read in the text


def text_decoder(tokenizer):
    """ids -> text, as `tokenizer.decode` gives it (special tokens skipped), except that special tokens whose
    text holds a marker the server's parsers read (`PARSED_MARKERS`) stay. A tokenizer may mark its chat-format
    tokens special; decoding them away would hide every tool call and reasoning end from the parsers.
    `tokenizer`: a `tokenizers.Tokenizer`."""
    added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
    special = {i for i, t in added.items() if t.special}
    keep = {i for i in special if any(m in added[i].content for m in PARSED_MARKERS)}
    if not keep:
        return tokenizer.decode
    drop = special - keep
    return lambda ids: tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)


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
