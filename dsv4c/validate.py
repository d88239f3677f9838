"""Argument checks shared by the CLI commands (and any new ones): each raises an error that names the
flag, the limit and the value, before any heavy work. The `argparse` types raise ArgumentTypeError, so
a bad value exits with code 2 and a one-line message, no traceback."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def int_at_least(low: int, flag: str):
    """An argparse type: an integer >= `low` (argparse's message names the flag; `flag` names the type)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v

    parse.__name__ = f"{flag} integer >= {low}"
    return parse


def float_in(low: float, high: float, flag: str, low_open: bool = False):
    """An argparse type: a number in [low, high] ((low, high] with `low_open`)."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not (low < v if low_open else low <= v) or not v <= high:
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {s}")
        return v

    parse.__name__ = f"{flag} number"
    return parse


def mtp_arg(s: str) -> int | str:
    """`--mtp`: 0 (off), k >= 1, or auto. The upper bound is the artifact's K (`check_mtp`)."""
    if s == "auto":
        return s
    try:
        return int_at_least(0, "--mtp")(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 0 (off), k >= 1 or auto, got {s!r}") from None


def check_mtp(mtp: int | str, manifest: dict, art) -> None:
    """Refuse `--mtp k` above the artifact's K from its manifest, before the artifact is loaded."""
    K = int(manifest.get("mtp_k", 0))
    if mtp != "auto" and mtp > K:
        raise ValueError(f"--mtp {mtp}: {art} was compiled with --mtp {K}, so k is at most {K}"
                         + ("" if K else " (no speculative decoding: recompile with --mtp K)"))


def device_arg(s: str) -> str:
    """`--device`: a torch device this machine has (cuda needs a visible GPU)."""
    import torch

    try:
        d = torch.device(s)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a device; dsv4c runs on cpu or cuda") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{s}: no CUDA GPU is visible on this machine; use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{s}: this machine has {torch.cuda.device_count()} GPU(s)")
    elif d.type != "cpu":
        raise argparse.ArgumentTypeError(f"{s}: dsv4c runs on cpu or cuda, not {d.type}")
    return s


def utf8_text(flag: str):
    """An argparse type for text: command-line bytes that are not UTF-8 reach Python as lone surrogates
    (surrogateescape); refuse them naming the byte, instead of failing in the tokenizer."""
    def parse(s: str) -> str:
        try:
            check_utf8(s, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
        return s

    return parse


def check_utf8(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start].encode("utf-8", "surrogateescape")
        raise ValueError(f"{what}: not valid UTF-8 (byte 0x{bad.hex()} at character {e.start})") from None


def read_prompt_file(path: str) -> str:
    """`--prompt-file PATH` (`-`: standard input): the whole file is one prompt, UTF-8."""
    name = "<stdin>" if path == "-" else path
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except IsADirectoryError:
        raise ValueError(f"--prompt-file {name}: is a folder") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"--prompt-file {name}: no such file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {name}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start})") from None
    if not text:
        raise ValueError(f"--prompt-file {name}: is empty")
    return text


def plan_dir_outside(art: Path, plan_dir: Path) -> Path:
    """`inspect --plan` writes beside, never into, the artifact (its manifest hashes every file)."""
    a, p = Path(art).resolve(), Path(plan_dir).resolve()
    if p == a or a in p.parents:
        raise ValueError(f"--plan-dir {plan_dir}: inside the artifact {art}; write the plan elsewhere "
                         f"(the manifest lists every file of the artifact)")
    return Path(plan_dir)
