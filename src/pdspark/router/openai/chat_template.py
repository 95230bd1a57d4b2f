"""`ChatTemplate`: renders chat messages into a prompt with the model's Jinja chat template (sandboxed)."""

from __future__ import annotations

from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a checkpoint ships a tokenizer without a chat template.
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str | None):
        env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        self.source = source or DEFAULT_TEMPLATE  # the template's text (what `/tokenizer_info` hands out)
        self.template = env.from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: object) -> str:
        """`kwargs`: more variables for the template (`tools`, a request's `chat_template_kwargs`)."""
        return self.template.render(**{**kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt})
