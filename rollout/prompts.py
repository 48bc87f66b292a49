"""Turning dataset rows into prompt text and token ids: a plain template or the tokenizer's chat template."""

from __future__ import annotations

import numbers
import re
import string
from collections.abc import Sequence


def check_prompt_column(column_names: Sequence[str], prompt_column: str, where: str = "the dataset") -> None:
    """Refuse, in one line, `column_names` (of `where`: the dataset, or one row) without the prompt column."""
    if prompt_column not in column_names:
        names = list(column_names)
        if {"role", "content"} <= set(names):  # a chat message taken for a row: a conversation passed unwrapped
            raise ValueError(
                f"{where} is a chat message ({', '.join(names)}), not a row with a {prompt_column!r} column: data is a "
                "list of prompts, so one conversation goes in a list of its own ([[{'role': 'user', 'content': "
                "...}]])"
            )
        raise ValueError(
            f"data.prompt_column: {where} has no column {prompt_column!r}; its columns: "
            f"{', '.join(names)}; set data.prompt_column to the one that holds the prompts"
        )


def prompt_kind(item) -> str:
    """What one entry of a call's data is: "row" (a dict with columns), "text", "chat" (a list of message dicts) or
    "token ids" (a list of integers)."""
    if isinstance(item, str):
        return "text"
    if isinstance(item, dict) or hasattr(item, "keys"):
        return "row"
    value = item.tolist() if getattr(item, "ndim", None) == 0 else item  # a 1-D array's elements: 0-d arrays
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # a flat list of ids, or a 1-D array
        raise ValueError(
            f"data holds the token id {item!r:.30}: data is a list of prompts, so one prompt of token ids goes in a "
            "list of its own ([[5, 6, 7]])"
        )
    if isinstance(item, (list, tuple)) or (hasattr(item, "tolist") and getattr(item, "ndim", 1) != 0):
        values = item.tolist() if hasattr(item, "tolist") else list(item)
        if values and all(isinstance(m, dict) for m in values):
            return "chat"
        if values and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in values):
            return "token ids"
        if not values:
            raise ValueError("data holds an empty prompt ([]): every prompt needs at least one token or message")
    raise ValueError(
        f"data holds {type(item).__name__} {item!r:.60}: a prompt is a row (dict), a string, a list of chat messages "
        "or a list of token ids"
    )


def template_fields(template: str) -> list[tuple[str, str | None]]:
    """The (field, conversion) of each replacement field of a `str.format` template; refused (ValueError) when it is
    not one, or when it names no field (every prompt would be that same text)."""
    try:
        fields = [(field, conv) for _, field, _, conv in string.Formatter().parse(template) if field is not None]
    except ValueError as err:
        raise ValueError(f"data.template ({template!r:.60}) is not a str.format template: {err}") from None
    if not fields:
        raise ValueError(
            f"data.template ({template!r:.60}) names no column, so every prompt would be that same text: put the "
            "prompt's column in braces, e.g. 'Question: {question}\\nAnswer:'"
        )
    for field, _ in fields:
        attribute = _attribute(field)
        if attribute is not None:  # {prompt.upper} would format the method's repr into every prompt
            raise ValueError(
                f"data.template ({template!r:.60}) reads the attribute .{attribute} in {{{field}}}: a template takes "
                "columns and items of them ({question}, {choices[0]}, {meta[topic]}), not attributes or methods"
            )
    return fields


def _attribute(field: str) -> str | None:
    """The first attribute a `str.format` field name reads (`upper` in `prompt.upper`), None if it reads none (dots
    inside an item's brackets are part of its key)."""
    inside = False
    for i, char in enumerate(field):
        if char in "[]":
            inside = char == "["
        elif char == "." and not inside:
            return re.split(r"[.\[]", field[i + 1 :], maxsplit=1)[0]
    return None


class PromptFormatter:
    """Formats rows into prompts.

    Args:
        tokenizer: the model's tokenizer.
        prompt_column: the column holding the prompt: a string, or (with `chat_template`) a list of chat messages.
        template: a `str.format` template over the row's columns, e.g. "Question: {question}\\nAnswer:";
            None uses the prompt column as is.
        chat_template: wrap the text as a user message (after `system_prompt`) in the tokenizer's chat template,
            with the generation prompt added.
        system_prompt: the system message for `chat_template`; None sends none.
    """

    def __init__(
        self,
        tokenizer,
        prompt_column: str = "prompt",
        template: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ):
        if system_prompt is not None and not chat_template:  # it would be left out of every prompt
            raise ValueError(
                "system_prompt (data.system_prompt) is a chat template's system message: set chat_template "
                "(data.chat_template) too, or give no system prompt"
            )
        if chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "data.chat_template is true but the tokenizer has no chat template; "
                "set data.chat_template=false and give a plain data.template"
            )
        if template is not None:
            template_fields(template)
        self.tokenizer = tokenizer
        self.prompt_column = prompt_column
        self.template = template
        self.chat_template = chat_template
        self.system_prompt = system_prompt

    def text(self, row: dict) -> str:
        """The prompt text of one row (chat-templated when asked)."""
        if self.template is None:
            value = row[self.prompt_column]  # (every row checked by `__call__`)
        else:
            try:
                value = self.template.format(**row)
            except KeyError as err:
                raise ValueError(
                    f"data.template names the column {err.args[0]!r} that the dataset lacks; "
                    f"its columns: {', '.join(row)}"
                ) from None
            except (AttributeError, IndexError, TypeError, ValueError) as err:  # {x.attr}, {x[9]}, {x!z}, {x:d}
                raise ValueError(
                    f"data.template ({self.template!r:.60}) cannot be filled from a row: {type(err).__name__}: {err}"
                ) from None
        if not self.chat_template:
            if not isinstance(value, str):
                chat = isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) == 1  # (an array: parquet's)
                fix = "set data.chat_template=true for chat messages" if chat else "every row needs its prompt there"
                raise ValueError(
                    f"data.prompt_column {self.prompt_column!r} holds {type(value).__name__} {value!r:.40}, not text: "
                    f"{fix}, or give a data.template"
                )
            return value
        if hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1:  # a DataFrame's or parquet's cell: an array
            value = value.tolist()
        if isinstance(value, (list, tuple)):  # already a conversation
            messages = list(value)
        elif isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        elif isinstance(value, dict):  # one message, not put in a conversation
            raise ValueError(
                f"data.prompt_column {self.prompt_column!r} holds one chat message (a dict), not a conversation: a "
                "conversation is a list of messages, so put it in a list ([message])"
            )
        else:  # None (a row without it), a number (pandas' NaN): not text to put in a user message
            raise ValueError(
                f"data.prompt_column {self.prompt_column!r} holds {type(value).__name__} {value!r:.40}, not text or a "
                "list of chat messages: every row needs its prompt there"
            )
        if self.system_prompt is not None:
            if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
                raise ValueError(
                    "data.system_prompt is set and a conversation in the data has a system message of its own: give "
                    "one or the other"
                )
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:
            if not type(err).__module__.startswith("jinja2"):
                raise
            # the template's own refusal ("System role not supported") or a template that does not parse: name it
            system = " (data.system_prompt went in as a system message)" if self.system_prompt is not None else ""
            said = " ".join(str(err).split())
            raise ValueError(
                f"the tokenizer's chat template failed on a prompt's messages{system}: {type(err).__name__}: {said}"
            ) from None

    def __call__(self, rows: Sequence[dict]) -> tuple[list[str], list[list[int]]]:
        """(prompt texts, prompt token ids) of the rows; without a template, every row's prompt column is checked
        first (a list of dicts may differ from row to row)."""
        if self.template is None:  # (a template names its own columns)
            for i, row in enumerate(rows):
                check_prompt_column(list(row), self.prompt_column, "the data" if len(rows) == 1 else f"row {i}")
        texts = [self.text(row) for row in rows]
        # a chat template writes its own special tokens; a plain prompt gets the tokenizer's (e.g. a BOS)
        encoded = self.tokenizer(texts, add_special_tokens=not self.chat_template)["input_ids"]
        return texts, [list(ids) for ids in encoded]
