"""The server's reasoning parser (runtime/serve.py `_ReasoningSplit`, `reasoning_parser_for`): DeepSeek's
thinking format split into reasoning_content and content, the same whichever pieces the text arrives in."""
from __future__ import annotations

import pytest

from dsv4c.runtime.serve import _ReasoningSplit, reasoning_parser_for

CASES = [  # (prompt's end, completion, reasoning, answer)
    ("<｜Assistant｜><think>", "2 + 2: add.</think>It is 4.", "2 + 2: add.", "It is 4."),  # V4 / V3.1 thinking
    ("<｜Assistant｜></think>", "It is 4.", "", "It is 4."),  # their non-thinking mode
    ("<｜Assistant｜>", "It is 4.", "", "It is 4."),  # a template without thinking
    ("<｜Assistant｜>", "<think>\nadd</think>\n\nIt is 4.", "\nadd", "\n\nIt is 4."),  # R1-0528 opens it itself
    ("<｜Assistant｜>", "\n <think>a</think>b", "a", "b"),  # whitespace before the model's own tag
    ("<｜Assistant｜><think>", "a < b and </thin k></think>x </think> y", "a < b and </thin k>", "x </think> y"),
    ("<｜Assistant｜><think>", "still thinking </thi", "still thinking </thi", ""),  # cut short (length)
    ("<｜Assistant｜>", "<thin", "", "<thin"),  # a tag's start that never became one
    ("<think>old</think><｜User｜>q<｜Assistant｜>", "<t>x</think>", "", "<t>x</think>"),  # an earlier turn closed it
]


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("prompt,text,reasoning,answer", CASES)
def test_split_is_the_same_for_every_way_the_text_arrives(prompt, text, reasoning, answer):
    """Whole, one character at a time, and cut at every point into two: the pieces' reasoning and answer
    concatenate to the same split, and nothing is lost or repeated."""
    ways = [[text], list(text)] + [_pieces(text, [i]) for i in range(1, len(text))]
    for pieces in ways:
        split, got_r, got_a = _ReasoningSplit(prompt), "", ""
        for i, p in enumerate(pieces):
            r, a = split.push(p, final=i == len(pieces) - 1)
            got_r, got_a = got_r + r, got_a + a
        assert (got_r, got_a) == (reasoning, answer), pieces


def test_a_partial_tag_is_held_back_until_the_next_piece():
    split = _ReasoningSplit("<think>")
    assert split.push("abc</th", final=False) == ("abc", "")
    assert split.push("ink>def", final=False) == ("", "def")
    split = _ReasoningSplit("")
    assert split.push(" <th", final=False) == ("", "")  # could be the model's own <think>
    assert split.push("ink>r", final=False) == ("r", "")


def test_auto_is_deepseek_where_the_template_closes_think():
    assert reasoning_parser_for("auto", "{% if thinking %}<think>{% else %}</think>{% endif %}") == "deepseek"
    assert reasoning_parser_for("auto", "{{ bos_token }}{% for m in messages %}...{% endfor %}") == "none"
    assert reasoning_parser_for("auto", None) == "none"
    assert reasoning_parser_for("deepseek", None) == "deepseek" and reasoning_parser_for("none", "</think>") == "none"
    with pytest.raises(ValueError, match="reasoning_parser: expected one of auto, deepseek, none"):
        reasoning_parser_for("r1", None)


DS = "｜DSML｜"
CALLS = (f'\n\n<{DS}tool_calls>\n<{DS}invoke name="f">\n<{DS}parameter name="a" string="true">x\n\ny</{DS}parameter>\n'
         f'</{DS}invoke>\n</{DS}tool_calls>')
TOOL_CASES = [  # (answer text, content, calls as (name, arguments))
    ("Let me check." + CALLS, "Let me check.", [("f", {"a": "x\n\ny"})]),
    (CALLS.lstrip("\n"), CALLS.lstrip("\n"), []),  # no blank line before it: not a call block
    ("Text only.\n\n", "Text only.\n\n", []),  # a tail that could have started a block
    ("Cut" + CALLS[:40], "Cut" + CALLS[:40], []),  # cut short: what the model wrote, as text
]


@pytest.mark.parametrize("text,content,calls", TOOL_CASES)
def test_tool_call_split_is_the_same_for_every_way_the_text_arrives(text, content, calls):
    """The server's DSML splitter (`_ToolCallSplit`): the content streams out before the block, held back only
    while it could still be the block's start; the calls are parsed at the end; a block that does not parse
    comes back as text. Whole, one character at a time, and cut at every point: the same result."""
    import json

    from dsv4c.runtime.serve import _ToolCallSplit

    for pieces in [[text], list(text)] + [_pieces(text, [i]) for i in range(1, len(text))]:
        split, got = _ToolCallSplit(), ""
        for i, p in enumerate(pieces):
            got += split.push(p, final=i == len(pieces) - 1)
        assert got == content, pieces
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in split.calls] == calls
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in split.calls)
    split = _ToolCallSplit()
    assert split.push("Hi\n\n<", final=False) == "Hi"  # held: could be the block's start


def test_markers_survive_decoding_where_the_tokenizer_marks_them_special():
    """A tokenizer may mark its chat-format tokens special; `tokenizer.decode` then drops them, and the server
    would see neither tool calls nor the end of reasoning. `text_decoder` keeps special tokens holding the
    DSML marker and the think tags and drops the other special tokens, as decode does. Fed through the
    server's detokenizer and splitters one token at a time, the answer splits as its text does."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer

    from dsv4c.chat_templates import text_decoder
    from dsv4c.runtime.serve import _Detokenizer, _ToolCallSplit

    tok = Tokenizer.from_file(str(Path(__file__).resolve().parents[1] / "examples/models/v4-tiny-pystdlib/tokenizer.json"))
    tok.add_special_tokens([DS, "</think>", "<｜end▁of▁sentence｜>"])
    text = "a</think>Let me check." + CALLS
    ids = tok.encode(text + "<｜end▁of▁sentence｜>", add_special_tokens=False).ids
    for marker in (DS, "</think>", "<｜end▁of▁sentence｜>"):
        assert tok.token_to_id(marker) in ids, marker  # each marker is one special token here
    assert DS not in tok.decode(ids) and "</think>" not in tok.decode(ids)  # what decode alone gives
    decode = text_decoder(tok)
    assert decode(ids) == tok.decode(ids, skip_special_tokens=False).replace("<｜end▁of▁sentence｜>", "")
    detok, reasoning, tools, answer = _Detokenizer(decode, []), _ReasoningSplit("<think>"), _ToolCallSplit(), ""
    for i in range(len(ids)):
        final = i == len(ids) - 1
        _, a = reasoning.push(detok.push(ids[i:i + 1], final), final)
        answer += tools.push(a, final)
    assert answer == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tools.calls] == \
        [("f", {"a": "x\n\ny"})]
    plain = Tokenizer.from_file(str(Path(__file__).resolve().parents[1] / "examples/models/v4-tiny-pystdlib/tokenizer.json"))
    assert text_decoder(plain) == plain.decode  # no special marker tokens: decode as it is
