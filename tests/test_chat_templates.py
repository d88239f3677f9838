"""The built-in DeepSeek-V4 chat template (dsv4c/chat_templates.py), rendered as the server renders it,
against prompts written out by hand from the model card's encoding rules, and `compile` writing it into
artifacts of V4 checkpoints that bring no template."""
from __future__ import annotations

import json

import pytest
import torch

from dsv4c.chat_templates import DEEPSEEK_V4, MAX_EFFORT_PREAMBLE, builtin_chat_template, load_chat_template

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
    ([{"role": "user", "content": Q1}, {"role": "user", "content": Q2}], {"thinking": True},
     BOS + U + Q1 + U + Q2 + A + "<think>"),  # consecutive user turns: one assistant prefix, at the end
]


@pytest.mark.parametrize("messages,kwargs,prompt", CASES)
def test_deepseek_v4_template_writes_the_model_cards_prompts(messages, kwargs, prompt):
    assert render(messages, **kwargs) == prompt


def test_unknown_roles_are_refused_and_the_generation_prompt_is_optional():
    from jinja2.exceptions import TemplateError

    from dsv4c.runtime.serve import ChatTemplate

    with pytest.raises(TemplateError, match="unknown role: tool"):
        render([{"role": "tool", "content": "x"}])
    t = ChatTemplate(DEEPSEEK_V4, BOS, EOS)
    assert t.render(TURNS[:2], add_generation_prompt=False) == BOS + SYS + U + Q1


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
