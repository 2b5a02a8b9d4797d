"""kvgen.chat_template: reading a chat template given as a file path or as its Jinja text."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen.chat_template import read_chat_template

# ChatML on one line (its newlines escaped inside the Jinja strings), as most model templates ship: 284 characters
ONE_LINE_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}{# a one-line template longer than the longest file name the OS takes #}")


def test_a_one_line_template_longer_than_a_file_name_is_the_template() -> None:
    """``Path(text).is_file()`` raised OSError (ENAMETOOLONG) past 255 characters, so ``LLM.chat(chat_template=)`` and
    ``kvgen serve --chat-template`` failed on most real templates given inline; vLLM's ``load_chat_template`` treats
    such a value as the template."""
    assert len(ONE_LINE_CHATML) > 255 and "\n" not in ONE_LINE_CHATML
    assert read_chat_template(ONE_LINE_CHATML) == ONE_LINE_CHATML


def test_a_file_is_read_and_a_name_that_is_neither_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(ONE_LINE_CHATML)
    assert read_chat_template(str(tmp_path / "t.jinja")) == ONE_LINE_CHATML
    with pytest.raises(ValueError, match="is neither a file nor"):
        read_chat_template(str(tmp_path / "absent.jinja"))
