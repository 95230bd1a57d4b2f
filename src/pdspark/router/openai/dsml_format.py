"""DeepSeek's DSML: how DSV4 writes tool calls, and how tool definitions and results are put in its prompt.

A call block, as the model writes it (the format xgrammar's `deepseek_v4` structural tag constrains; V3.2 named the
block `function_calls`, V4 `tool_calls`):

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A parameter is `string="true"` with its raw text, or `string="false"` with its value in JSON. The prompt side follows
DeepSeek's published encoding (V3.2's `encoding_dsv32.py`, with V4's block name): the tool definitions as JSON lines
in a `## Tools` section of the system prompt, an assistant turn's calls as the block above after its content, and
the tools' results in the next user turn as `<function_results><result>...</result>...</function_results>`.
"""

from __future__ import annotations

import json
from typing import Any

DSML = "｜DSML｜"
CALLS_BEGIN = f"<{DSML}tool_calls>"
CALLS_END = f"</{DSML}tool_calls>"
INVOKE_PREFIX = f'<{DSML}invoke name="'
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_PREFIX = f'<{DSML}parameter name="'
PARAMETER_END = f"</{DSML}parameter>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"

TOOLS_SECTION = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "{begin}" block like the following as part of your reply to the user:
{begin}
{invoke}$FUNCTION_NAME">
{parameter}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{parameter_end}
...
{invoke_end}
{end}

String and scalar parameters should be specified as is, while lists and objects should use JSON format. The "string" \
attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, \
objects).

Here are the functions available in JSONSchema format:
<functions>
{functions}
</functions>"""


def tools_section(functions: list[dict[str, Any]]) -> str:
    """The system prompt's section that describes `functions` (OpenAI's `function` objects)."""
    return TOOLS_SECTION.format(begin=CALLS_BEGIN, end=CALLS_END, invoke=INVOKE_PREFIX, invoke_end=INVOKE_END,
                                parameter=PARAMETER_PREFIX, parameter_end=PARAMETER_END,
                                functions="\n".join(json.dumps(f, ensure_ascii=False) for f in functions))


def calls_block(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """`(name, arguments)` pairs as the model writes them (an assistant turn's calls in a prompt)."""
    invokes = "".join(f'{INVOKE_PREFIX}{name}">\n' + "".join(_parameter(k, v) for k, v in args.items()) +
                      f"{INVOKE_END}\n" for name, args in calls)
    return f"\n\n{CALLS_BEGIN}\n{invokes}{CALLS_END}"


def _parameter(name: str, value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return f'{PARAMETER_PREFIX}{name}" string="{"true" if isinstance(value, str) else "false"}">{text}{PARAMETER_END}\n'


def results_block(results: list[str]) -> str:
    """Tool results (one per `role: tool` message, in order) as the next user turn carries them."""
    return "<function_results>\n" + "".join(f"<result>{r}</result>\n" for r in results) + "</function_results>"
