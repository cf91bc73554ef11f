"""Prompt messages -> token ids: through the tokenizer's chat template, or as raw text for tokenizers without one."""

from __future__ import annotations

from megatron_dapo.data.prompt_file import DataError


def raw_prompt_text(messages: list[dict]) -> str:
    """The prompt as plain text: the messages' contents, in order, one per line."""
    return "\n".join(m["content"] for m in messages)


def encode_prompt(tokenizer, messages: list[dict], raw_prompt: bool = False) -> list[int]:
    """Token ids of a prompt, ending where the response starts.

    With the chat template (the default) this is the conversation plus the assistant header
    (add_generation_prompt); with raw_prompt it is raw_prompt_text(messages), tokenized with the
    tokenizer's own special tokens (e.g. a BOS), for models trained without a template.
    """
    if raw_prompt:
        ids = tokenizer.encode(raw_prompt_text(messages), add_special_tokens=True)
    else:
        if not tokenizer.chat_template:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise DataError(f"tokenizer {name!r} has no chat template: set one (tokenizer.chat_template, or a "
                            "chat_template.jinja in the tokenizer folder), or use the raw prompt option to feed the "
                            "prompt text without a template")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if not ids:
        raise DataError(f"prompt {raw_prompt_text(messages)[:80]!r} encodes to no tokens")
    return list(ids)
