"""Generate a function-calling preference data set (JSONL pairs) from the function-calling chats.

  python scripts/make_preference_data.py --num-examples 2000 --seed 0 --output /tmp/pref.jsonl

Each record is a conversational preference pair in TRL's format:
  {"prompt": [messages up to one assistant turn], "chosen": [that assistant turn],
   "rejected": [a plausibly wrong assistant turn]}
The chats come from scripts/make_function_calling_data.py; one assistant turn of each is picked and the
rejected reply made from it by a deterministic corruption that fits the turn:
  a tool call      another function's name, a wrong argument value, a missing required argument,
                   malformed tool-call JSON, or a text answer instead of the call
  a final answer   a number the tool returned misquoted, or the same tool called again
  a clarification  a call with made-up arguments instead of asking for them
  a refusal        a call of a declared function that does not fit the request
The chosen reply always follows the tool schemas and the tool results in the prompt, and the rejected
one never does, so a model can learn the preference from the data. The output is a pure function of
--seed and --num-examples; prepare it with scripts/prepare_data.py like any JSONL.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_function_calling_data as fc  # noqa: E402

TOOLS = {t.name: t for t in fc.TOOLS}
CALL_CORRUPTIONS = ("wrong_function", "wrong_argument", "missing_argument", "malformed_json", "text_instead")
# A quantity in an answer: not part of a date, a time, a tracking number or "6-day".
_NUMBER = re.compile(r"(?<![\w:.-])\d+(?:\.\d+)?(?![\w:-])")


def declared(messages: list[dict]) -> list[str]:
    """The names of the functions the chat's system message declares."""
    body = messages[0]["content"].split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    return [json.loads(line)["name"] for line in body.splitlines()]


def parse_call(content: str) -> dict | None:
    """The {"name", "arguments"} of a tool-call reply, None for a reply in text."""
    if not content.startswith("<tool_call>\n"):
        return None
    return json.loads(content.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))


def render_call(name: str, arguments: dict) -> str:
    """A tool-call reply exactly as the chats write one."""
    return fc._call(TOOLS[name], arguments)


def _other_value(r: random.Random, tool: fc.Tool, key: str, value):
    """Another plausible value of argument `key` of `tool` (a fresh sample), or None if none differs."""
    for _ in range(20):
        candidate = tool.sample(r).get(key)
        if candidate is not None and candidate != value:
            return candidate
    return None


def corrupt_call(r: random.Random, call: dict, names: list[str]) -> str:
    """A wrong reply where `call` (of one of the declared `names`) is right."""
    tool, args = TOOLS[call["name"]], dict(call["arguments"])
    kinds = list(CALL_CORRUPTIONS)
    if not any(k in args for k in tool.required):
        kinds.remove("missing_argument")
    while True:
        kind = r.choice(kinds)
        if kind == "wrong_function":
            others = [n for n in names if n != tool.name] or [n for n in sorted(TOOLS) if n != tool.name]
            return render_call(r.choice(others), args)
        if kind == "missing_argument":
            del args[r.choice([k for k in tool.required if k in args])]
            return render_call(tool.name, args)
        if kind == "malformed_json":
            text = json.dumps({"name": tool.name, "arguments": args}, ensure_ascii=False)
            broken = r.choice([text[:-1], text.replace('"', "'"), text.replace('"arguments": ', "")])
            return f"<tool_call>\n{broken}\n</tool_call>"
        if kind == "text_instead":
            shown = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in args.items())
            return r.choice(
                (
                    f"Sure, I'll {tool.description[0].lower()}{tool.description[1:]} for you ({shown}).",
                    f"I don't have live data, but {tool.name.replace('_', ' ')} with {shown} is usually fine.",
                )
            )
        key = r.choice(sorted(args))
        value = _other_value(r, tool, key, args[key])
        if value is not None:
            args[key] = value
            return render_call(tool.name, args)
        kinds.remove("wrong_argument")


def corrupt_answer(r: random.Random, answer: str, last_call: dict) -> str:
    """A wrong final answer: a number of the tool's result misquoted, or the tool called again."""
    numbers = list(_NUMBER.finditer(answer))
    if numbers and r.random() < 0.75:
        found = r.choice(numbers)
        text = found.group()
        digits = len(text.split(".")[1]) if "." in text else 0
        shown = text
        while shown == text:
            shown = f"{float(text) * r.choice((0.5, 0.8, 1.25, 2.0)) + r.choice((1, 3, 7)):.{digits}f}"
        return answer[: found.start()] + shown + answer[found.end() :]
    return render_call(last_call["name"], last_call["arguments"])


def preference_pair(r: random.Random, messages: list[dict]) -> dict:
    """One {"prompt", "chosen", "rejected"} record from a chat: one of its assistant turns, corrupted."""
    names = declared(messages)
    turn = r.choice([i for i, m in enumerate(messages) if m["role"] == "assistant"])
    content = messages[turn]["content"]
    call = parse_call(content)
    calls = [
        (i, c) for i, m in enumerate(messages) if m["role"] == "assistant" and (c := parse_call(m["content"]))
    ]
    later = [c for i, c in calls if i > turn]
    if call is not None:
        rejected = corrupt_call(r, call, names)
    elif messages[turn - 1]["role"] == "tool":
        rejected = corrupt_answer(r, content, [c for i, c in calls if i < turn][-1])
    elif later:
        # a clarifying question: the call the chat makes once the user answered, with made-up values
        tool = TOOLS[later[0]["name"]]
        sample = tool.sample(r)
        guessed = {k: sample[k] for k in tool.required}
        if guessed == later[0]["arguments"]:
            guessed = {k: _other_value(r, tool, k, v) or v for k, v in guessed.items()}
        rejected = render_call(tool.name, guessed)
    else:
        # a refusal: no declared function fits, so calling one is wrong
        tool = TOOLS[r.choice(names)]
        sample = tool.sample(r)
        rejected = render_call(tool.name, {k: sample[k] for k in tool.required})
    if rejected == content:
        raise AssertionError(f"corruption left the reply unchanged: {content!r}")
    return {
        "prompt": messages[:turn],
        "chosen": [{"role": "assistant", "content": content}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def generate(num_examples: int, seed: int):
    """Preference records, a pure function of (num_examples, seed)."""
    r = random.Random(seed)
    for _ in range(num_examples):
        yield preference_pair(r, fc.make_example(r))


def main(argv=None) -> int:
    return fc.generator_main(argv, __doc__.splitlines()[0], generate, "preference pairs")


if __name__ == "__main__":
    sys.exit(main())
