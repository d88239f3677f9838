"""The built-in DeepSeek-V4 chat template (dsv4c/chat_templates.py), rendered as the server renders it,
against prompts written out by hand from the model card's encoding rules, and `compile` writing it into
artifacts of V4 checkpoints that bring no template."""
from __future__ import annotations

import json

import pytest
import torch

from dsv4c.chat_templates import (DEEPSEEK_V4, MAX_EFFORT_PREAMBLE, TOOLS_HEAD, TOOLS_TAIL, ToolCallFormatError,
                                  builtin_chat_template, load_chat_template, parse_tool_calls, split_tool_calls)

BOS, EOS, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def render(messages, **extra) -> str:
    from dsv4c.runtime.serve import ChatTemplate

    return ChatTemplate(DEEPSEEK_V4, BOS, EOS).render(messages, add_generation_prompt=True, extra=extra)


SYS, Q1, A1, R1, Q2 = "You are a helpful assistant.", "What is 2+2?", "4.", "Add them.", "And 3+3?"
TURNS = [{"role": "system", "content": SYS}, {"role": "user", "content": Q1},
         {"role": "assistant", "content": A1, "reasoning_content": R1}, {"role": "user", "content": Q2}]
CASES = [  # (messages, chat_template_kwargs, prompt)
    (TURNS[:2], {"thinking": True}, BOS + SYS + U + Q1 + A + "<think>"),  # the model card's quick start
    (TURNS[:2], {}, BOS + SYS + U + Q1 + A + "</think>"),  # non-thinking (the default)
    (TURNS[:2], {"thinking": False}, BOS + SYS + U + Q1 + A + "</think>"),
    # earlier turns: their reasoning dropped, their user turn answered directly
    (TURNS, {"thinking": True}, BOS + SYS + U + Q1 + A + "</think>" + A1 + EOS + U + Q2 + A + "<think>"),
    (TURNS, {}, BOS + SYS + U + Q1 + A + "</think>" + A1 + EOS + U + Q2 + A + "</think>"),
    # a prefilled reply after the last user turn keeps its reasoning in thinking mode
    (TURNS[:3], {"thinking": True}, BOS + SYS + U + Q1 + A + "<think>" + R1 + "</think>" + A1 + EOS),
    (TURNS[:3], {}, BOS + SYS + U + Q1 + A + "</think>" + A1 + EOS),
    # maximum effort: the preamble after BOS, in thinking mode only
    (TURNS[:2], {"thinking": True, "reasoning_effort": "max"}, BOS + MAX_EFFORT_PREAMBLE + SYS + U + Q1 + A + "<think>"),
    (TURNS[:2], {"thinking": True, "reasoning_effort": "high"}, BOS + SYS + U + Q1 + A + "<think>"),
    (TURNS[:2], {"reasoning_effort": "max"}, BOS + SYS + U + Q1 + A + "</think>"),
    # developer turns read as user turns; in thinking mode those before the last user turn are dropped
    ([{"role": "developer", "content": "D"}, {"role": "user", "content": Q1}], {"thinking": True},
     BOS + U + Q1 + A + "<think>"),
    ([{"role": "developer", "content": "D"}, {"role": "user", "content": Q1}], {}, BOS + U + "D" + U + Q1 + A + "</think>"),
    # consecutive user turns are one, their parts joined by a blank line (the encoder merges them)
    ([{"role": "user", "content": Q1}, {"role": "user", "content": Q2}], {"thinking": True},
     BOS + U + Q1 + "\n\n" + Q2 + A + "<think>"),
]


@pytest.mark.parametrize("messages,kwargs,prompt", CASES)
def test_deepseek_v4_template_writes_the_model_cards_prompts(messages, kwargs, prompt):
    assert render(messages, **kwargs) == prompt


def test_unknown_roles_are_refused_and_the_generation_prompt_is_optional():
    from jinja2.exceptions import TemplateError

    from dsv4c.runtime.serve import ChatTemplate

    with pytest.raises(TemplateError, match="unknown role: critic"):
        render([{"role": "critic", "content": "x"}])
    t = ChatTemplate(DEEPSEEK_V4, BOS, EOS)
    assert t.render(TURNS[:2], add_generation_prompt=False) == BOS + SYS + U + Q1


DS = "｜DSML｜"
WEATHER = {"name": "get_weather", "description": "Weather in a city (°C)",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
TOOLS = [{"type": "function", "function": WEATHER}]
SECTION = TOOLS_HEAD + json.dumps(WEATHER, ensure_ascii=False) + TOOLS_TAIL  # one JSON line per function, as given
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "units": ["C", "F"]}}}
BLOCK = (f'\n\n<{DS}tool_calls>\n<{DS}invoke name="get_weather">\n<{DS}parameter name="city" string="true">Zürich'
         f'</{DS}parameter>\n<{DS}parameter name="days" string="false">2</{DS}parameter>\n<{DS}parameter name="units" '
         f'string="false">["C", "F"]</{DS}parameter>\n</{DS}invoke>\n</{DS}tool_calls>')
TOOL_TURNS = [{"role": "system", "content": SYS}, {"role": "user", "content": Q1},
              {"role": "assistant", "content": "Let me look.", "reasoning_content": R1, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": Q2}]
TOOL_CASES = [  # (messages, chat_template_kwargs, prompt): written out from the model card's encoding rules
    # the tools follow the system turn after a blank line; a call is a DSML block after the answer, then EOS;
    # the result and the next user message are one user turn
    (TOOL_TURNS, {}, BOS + SYS + "\n\n" + SECTION + U + Q1 + A + "</think>" + "Let me look." + BLOCK + EOS + U
     + "<tool_result>sunny</tool_result>\n\n" + Q2 + A + "</think>"),
    # thinking mode with tools: no reasoning is dropped, every user turn opens <think>
    (TOOL_TURNS, {"thinking": True}, BOS + SYS + "\n\n" + SECTION + U + Q1 + A + "<think>" + R1 + "</think>"
     + "Let me look." + BLOCK + EOS + U + "<tool_result>sunny</tool_result>\n\n" + Q2 + A + "<think>"),
    # no system turn first: the tools open the prompt
    (TOOL_TURNS[1:2], {}, BOS + "\n\n" + SECTION + U + Q1 + A + "</think>"),
    # two results in a row: one user turn
    ([*TOOL_TURNS[1:3], {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}], {},
     BOS + "\n\n" + SECTION + U + Q1 + A + "</think>Let me look." + BLOCK + EOS + U
     + "<tool_result>a</tool_result>\n\n<tool_result>b</tool_result>" + A + "</think>"),
]


@pytest.mark.parametrize("messages,kwargs,prompt", TOOL_CASES)
def test_deepseek_v4_template_writes_tools_calls_and_results(messages, kwargs, prompt):
    assert render(messages, tools=TOOLS, **kwargs) == prompt


def test_a_call_with_json_text_arguments_is_refused_by_the_template():
    from jinja2.exceptions import TemplateError

    bad = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    with pytest.raises(TemplateError, match="arguments must be an object"):
        render([TOOL_TURNS[1], {**TOOL_TURNS[2], "tool_calls": [bad]}], tools=TOOLS)


def test_parsing_a_rendered_call_gives_it_back():
    """The template's block for two calls (one without arguments), parsed: the same names and arguments."""
    calls = [CALL, {"type": "function", "function": {"name": "now", "arguments": {}}}]
    head = render(TOOL_TURNS[1:2])
    text = render([TOOL_TURNS[1], {**TOOL_TURNS[2], "tool_calls": calls}])[len(head):-len(EOS)]
    content, got = split_tool_calls(text)
    assert content == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == \
        [("get_weather", CALL["function"]["arguments"]), ("now", {})]
    assert split_tool_calls("no calls here") == ("no calls here", [])


@pytest.mark.parametrize("block,why", [
    (f'<{DS}invoke name="f">\n', "expected a parameter or </"),  # cut short
    (f'<{DS}invoke name="f">\n<{DS}parameter name="x" string="false">{{oops</{DS}parameter>\n</{DS}invoke>\n'
     f'</{DS}tool_calls>', "not JSON"),
    (f'<{DS}invoke name="f">\n<{DS}parameter name="x" string="true">1</{DS}parameter>\n<{DS}parameter name="x" '
     f'string="true">2</{DS}parameter>\n</{DS}invoke>\n</{DS}tool_calls>', "given twice"),
    (f'</{DS}tool_calls> and more', "text after"),
    (f'<{DS}call name="f">\n</{DS}tool_calls>', "expected <"),
])
def test_malformed_blocks_are_refused_naming_the_problem(block, why):
    with pytest.raises(ToolCallFormatError, match=why):
        parse_tool_calls("\n" + block)


def test_compile_writes_the_builtin_template_only_where_the_checkpoint_has_none(tmp_path):
    """A V4 checkpoint with a tokenizer and no template: the artifact gets DEEPSEEK_V4 (the manifest says
    so, and hashes it); one with its own template keeps it; V3 has no built-in one."""
    from cut_presets import bundle_cut

    from dsv4c.compile import compile_checkpoint, describe_artifact
    from dsv4c.config import ModelConfig

    ckpt = bundle_cut(tmp_path / "ckpt", 1)
    own = load_chat_template(ckpt)
    assert own is not None and own != DEEPSEEK_V4
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    del tc["chat_template"]
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tc))
    compile_checkpoint(ckpt, tmp_path / "art", target="cpu", max_tokens=32, max_batch=1, dtype=torch.float32)
    m = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert m["chat_template"] == "built-in" and "chat_template.jinja" in m["files"]
    assert load_chat_template(tmp_path / "art") == DEEPSEEK_V4
    assert "chat       dsv4c's DeepSeek-V4 template (the checkpoint has none)" in describe_artifact(tmp_path / "art")
    assert builtin_chat_template(ModelConfig.preset("v3-tiny")) is None
    assert builtin_chat_template(ModelConfig.preset("v4-tiny-a")) == DEEPSEEK_V4
